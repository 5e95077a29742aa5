// Intel AMX helpers shared by amx_linear_cpu.cpp, the AMX-INT8 kernels (quant_amx_int8.h) and the AMX decode
// attention of fused_cpu.cpp (amx_attention.h): the CPU / kernel permission check, the LDTILECFG operand and the
// weight-tile prefetch. Included at global scope (before any namespace).
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace ascent_tiles {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request permission for an XSAVE feature
constexpr int kXfeatureXtiledata = 18;

// AMX-TILE and AMX-BF16 (CPUID.7.0:EDX bits 24 and 22) and the kernel's permission to use the tile state.
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// LDTILECFG operand, palette 1: tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..7 with rows[t] rows (at least 1) of 64 bytes.
inline TileConfig tile_config(const int64_t (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(std::max<int64_t>(rows[t], 1));
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// Prefetch of the weight tiles ahead of a K step of the column-block kernels (amx_linear_cpu.cpp, quant_amx_int8.h),
// whose 1 KiB B tiles of column block b sit at b0 / b1 + k * 1024: one T0 4 KiB and one T1 64 KiB ahead per 64-byte
// line of each stream. A tile load waits on its lines before the dot product that frees its tile register, so with
// the hardware prefetchers alone the tiles wait on memory. Measured on a Xeon with AMX (2 threads, bf16 tiles over
// SmolLM2's 120 decode linears + lm_head from DRAM, interleaved with the kernel without it): M = 4 0.94x, 16 0.95x,
// 32 0.84-0.90x, 64 0.93x the time; T0 alone at 2-8 KiB 0.90-0.96x; a far distance of 256 KiB 0.95-1.02x.
constexpr int64_t kTilePrefetchNear = 4096;
constexpr int64_t kTilePrefetchFar = 65536;

inline void prefetch_weight_tiles(const void* b0, const void* b1, int64_t k, int blocks) {
  const char* s0 = static_cast<const char*>(b0) + k * 1024;
  const char* s1 = static_cast<const char*>(b1) + k * 1024;
  for (int line = 0; line < 16; ++line) {
    _mm_prefetch(s0 + kTilePrefetchNear + 64 * line, _MM_HINT_T0);
    _mm_prefetch(s0 + kTilePrefetchFar + 64 * line, _MM_HINT_T1);
    if (blocks == 2) {
      _mm_prefetch(s1 + kTilePrefetchNear + 64 * line, _MM_HINT_T0);
      _mm_prefetch(s1 + kTilePrefetchFar + 64 * line, _MM_HINT_T1);
    }
  }
}

// Zeroes the accumulator tiles tmm4..7 the tile kernels use (the intrinsics take literal tile numbers).
__attribute__((target("amx-tile"))) inline void zero_accumulators() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

// LDTILECFG of cfg. The asm names all 64 bytes as its input: GCC's _tile_loadconfig names only the first 8, so
// behind a call its inter-procedural analysis may drop the stores of the rest (seen: a config of zeros, then #UD).
__attribute__((target("amx-tile"))) inline void load_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Releases the tile state (TILERELEASE).
__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

}  // namespace ascent_tiles
