// Software prefetch of the AVX2 row kernels' sequential weight streams (gemv_avx2.h, quant_int8_avx2.h and the blocked
// W4A16 kernel of quant_wo_fixed_avx2.h), chosen by CPU vendor. Included at global scope (before any namespace).
//
// On a Zen 2 (2 threads, the 120 linears of a SmolLM2-135M decode step, DRAM-resident) one non-temporal prefetch per
// 64-byte line ~900 B ahead took 0.80-0.87x the time of a T0 1 KiB + T1 4 KiB pair. On an Intel Xeon (Emerald
// Rapids class, the AVX2 paths forced) NTA took 1.59-1.64x the time of the pair for the bf16 GEMV (12.6 against 21.7
// GB/s), 1.69x for W8A8 and 1.12x for blocked W4A16, and a plain read loop with NTA prefetches read 18-20 GB/s against
// 34-36 with T0 / T1 / T2. So AMD CPUs take the NTA prefetch and every other CPU the T0 + T1 pair;
// ASCENT_CPU_NTA_PREFETCH=1 / 0 (read once) forces either.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace ascent_prefetch {

constexpr int64_t kT0Ahead = 1024;  // the pair: bytes ahead into L1
constexpr int64_t kT1Ahead = 4096;  // ... and into L2

// Whether the CPU's vendor string (CPUID leaf 0) is "AuthenticAMD".
inline bool amd_cpu() {
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
}

// Whether the row kernels stream with NTA prefetches (AMD, unless ASCENT_CPU_NTA_PREFETCH says otherwise).
inline bool nta_streams() {
  static const bool nta = [] {
    const char* v = std::getenv("ASCENT_CPU_NTA_PREFETCH");
    if (v != nullptr && std::strcmp(v, "1") == 0) return true;
    if (v != nullptr && std::strcmp(v, "0") == 0) return false;
    return amd_cpu();
  }();
  return nta;
}

// The prefetch for the 64-byte line at p of a stream read front to back: NTA `nta_ahead` bytes ahead, or T0 / T1
// kT0Ahead / kT1Ahead bytes ahead.
inline void stream_line(const char* p, bool nta, int64_t nta_ahead) {
  if (nta) {
    _mm_prefetch(p + nta_ahead, _MM_HINT_NTA);
  } else {
    _mm_prefetch(p + kT0Ahead, _MM_HINT_T0);
    _mm_prefetch(p + kT1Ahead, _MM_HINT_T1);
  }
}

// Indices [begin, end) (weight rows or column blocks) read as S side-by-side streams: the range is cut into S equal
// parts, and f(idx) gets index i of every part (idx[s] = begin + s * part + i, an int64_t[S]) for each i in turn;
// the indices left over then go to f one at a time (an int64_t[1]).
template <int S, typename F>
inline void side_by_side(int64_t begin, int64_t end, const F& f) {
  const int64_t part = (end - begin) / S;
  int64_t idx[S];
  for (int64_t i = 0; i < part; ++i) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) idx[s] = begin + s * part + i;
    f(idx);
  }
  for (int64_t n = begin + S * part; n < end; ++n) {
    const int64_t one[1] = {n};
    f(one);
  }
}

}  // namespace ascent_prefetch
