// RMSNorm of float32 rows on the CPU, and the residual add before it, in one call each:
//   rms_norm:      y = x / sqrt(mean(x^2) + eps) * weight
//   add_rms_norm:  r = residual + x;  y = rms_norm(r)   -> (y, r)
// where torch's CPU composite takes a handful of operations (~25 us a call at SmolLM2's
// 576 values, most of it dispatch). The squares are summed in eight float32 partial sums
// (k mod 8) added in a fixed order, so a row's result does not depend on the rows beside
// it. Threads: torch's intra-op pool, over rows.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kParts = 8;

// One row: y = x * inv_rms * w.
inline void norm_row(const float* x, const float* w, int64_t dim, float eps, float* y) {
  float part[kParts] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + kParts <= dim; k += kParts)
    for (int64_t j = 0; j < kParts; ++j) part[j] += x[k + j] * x[k + j];
  for (int64_t j = 0; k + j < dim; ++j) part[j] += x[k + j] * x[k + j];
  float total = 0.f;
  for (int64_t j = 0; j < kParts; ++j) total += part[j];
  const float inv = 1.f / std::sqrt(total / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * inv * w[i];
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(),
              "x: contiguous float32 [..., dim]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight: contiguous float32 [", x.size(-1), "]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(xp + r * dim, wp, dim, static_cast<float>(eps), yp + r * dim);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "residual: contiguous float32 of x's shape");
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(),
              *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < dim; ++i) sp[r * dim + i] = rp[r * dim + i] + xp[r * dim + i];
      norm_row(sp + r * dim, wp, dim, static_cast<float>(eps), yp + r * dim);
    }
  });
  return {y, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(infer_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
}
