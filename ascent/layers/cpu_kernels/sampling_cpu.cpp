// Sampler kernels for CPU: the inverse-CDF draw of the "host_cdf" RNG placement without materialising the cdf.
//
// ``torch.searchsorted(cumsum(probs.double()), u * total, right=True)`` converts [B,V] to fp64, writes the whole
// cumulative sum and searches it: three passes and two [B,V] fp64 tensors. Here each row is summed once in fp64 in
// the same left-to-right order as torch's CPU cumsum (so every partial sum, hence the chosen token, is bit-identical)
// and then scanned only up to the crossing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>

namespace {

// First index i with cdf[i] > target, where cdf is the running fp64 sum of row[0..V); V when no such index.
int64_t first_cdf_above(const float* row, int64_t vocab, double target) {
  double acc = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    acc += static_cast<double>(row[i]);
    if (acc > target) return i;
  }
  return vocab;
}

// The last index with a positive weight; V-1 for a row without one (as the torch path's flip/argmax gives).
int64_t last_positive(const float* row, int64_t vocab) {
  for (int64_t i = vocab - 1; i >= 0; --i)
    if (row[i] > 0.f) return i;
  return vocab - 1;
}

}  // namespace

// probs float32 [B,V] (non-negative, rows need not sum to 1), u float64 [B] in (0,1) -> int64 [B]: the number of
// fp64 cumulative sums <= u * total, clamped to the last positive-weight token when u * total rounds up to total.
torch::Tensor inverse_cdf_sample(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.device().is_cpu() && u.device().is_cpu(), "inverse_cdf_sample: CPU tensors only");
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "inverse_cdf_sample: probs must be float32 [B, V]");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == probs.size(0),
              "inverse_cdf_sample: u must be float64 [", probs.size(0), "]");
  TORCH_CHECK(probs.size(1) > 0, "inverse_cdf_sample: empty vocabulary");
  auto p = probs.contiguous();
  auto uc = u.contiguous();
  const int64_t rows = p.size(0), vocab = p.size(1);
  auto out = torch::empty({rows}, probs.options().dtype(at::kLong));
  const float* pd = p.data_ptr<float>();
  const double* ud = uc.data_ptr<double>();
  int64_t* od = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = pd + r * vocab;
      double total = 0.0;
      for (int64_t i = 0; i < vocab; ++i) total += static_cast<double>(row[i]);
      const int64_t idx = first_cdf_above(row, vocab, ud[r] * total);
      od[r] = idx < vocab ? idx : last_positive(row, vocab);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("inverse_cdf_sample", &inverse_cdf_sample,
        "inverse_cdf_sample(probs float32 [B,V], u float64 [B]) -> int64 [B] (fp64 cumsum + searchsorted right)");
}
