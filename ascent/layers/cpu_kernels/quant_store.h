// Output stores of quant_gemv_cpu.cpp's kernels (included there inside namespace ascent_quant's anonymous namespace):
// fp32 results rounded once to the output dtype, nearest-even as torch's casts.
#pragma once

// y[0, n) -> bf16 bits with c10::BFloat16's rounding (nearest even; NaN -> 0x7FC0), 8 values per step.
__attribute__((target("avx2"))) void bf16_row_store_avx2(const float* y, int64_t n, uint16_t* dst) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, lsb)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(y[i]).x;
}

bool use_avx2();

// Writes y (fp32) to out[m, n] in out's dtype (one rounding, nearest-even as torch's casts).
struct Store {
  void* base;
  at::ScalarType dtype;
  int64_t ld;
  void operator()(int64_t m, int64_t n, float y) const {
    switch (dtype) {
      case at::kFloat: static_cast<float*>(base)[m * ld + n] = y; break;
      case at::kBFloat16: static_cast<c10::BFloat16*>(base)[m * ld + n] = c10::BFloat16(y); break;
      default: static_cast<c10::Half*>(base)[m * ld + n] = c10::Half(y); break;
    }
  }
  // out[m, n0 .. n0 + count) = y[0 .. count) (a bf16 output 8 values per step on AVX2: the per-value stores cost
  // ~2 ns per weight row of a batch-1 W4A16 call, a tenth of the row's kernel time).
  void row(int64_t m, int64_t n0, int64_t count, const float* y) const {
    if (dtype == at::kBFloat16 && use_avx2()) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(static_cast<c10::BFloat16*>(base) + m * ld + n0);
      return bf16_row_store_avx2(y, count, dst);
    }
    for (int64_t i = 0; i < count; ++i) (*this)(m, n0 + i, y[i]);
  }
};
