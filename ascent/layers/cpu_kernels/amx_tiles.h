// Intel AMX helpers shared by amx_linear_cpu.cpp and the AMX decode attention of fused_cpu.cpp (amx_attention.h):
// the CPU / kernel permission check and the LDTILECFG operand. Included at global scope (before any namespace).
#pragma once
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

}  // namespace ascent_tiles
