// fp32 -> bf16 rounding in AVX2 registers, bit for bit as c10::BFloat16 rounds (nearest-even, NaN -> 0x7FC0). Shared
// by the AVX2 kernels of fused_cpu.cpp (avx2_bf16.h) and gemv_cpu.cpp (gemv_panel_avx2.h); included inside their
// anonymous namespaces, after <immintrin.h>.
#pragma once

// The bf16 bits of 8 fp32 lanes, in the 8 16-bit lanes of a __m128i.
__attribute__((target("avx2,fma"))) inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; qwords 0 and 2 hold r0..r7 (all < 2^16: exact)
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// 8 bf16 bits (as bf16_bits8 returns them) widened back to fp32.
__attribute__((target("avx2,fma"))) inline __m256 bf16_bits8_to_f32(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
