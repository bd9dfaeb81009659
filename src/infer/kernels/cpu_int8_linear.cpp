// Linear layers with INT8 weights, one float scale per output channel (W8A16 on the CPU):
//   y[r, n] = scale[n] * sum_k x[r, k] * w[n, k]
// x stays float32; each weight is made float32 (sign-extended, converted) and multiplied in
// float32, the sums in lanes (8 with AVX2, 16 with AVX-512) and a fixed order, so a row's
// result does not depend on how many rows share the call. Threads: torch's intra-op pool,
// split over output channels.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kRowsInCache = 64;  // rows of x a pass over the weights takes
constexpr int64_t kRowsForPairs = 16;  // from this many rows, two weight rows at once

#ifdef __AVX512F__
using Lanes = __m512;  // 16 float32 lanes
constexpr int64_t kLanes = 16;
inline Lanes zero() { return _mm512_setzero_ps(); }
inline Lanes floats(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes weights(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
}
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(Lanes v) { return _mm512_reduce_add_ps(v); }
#else
using Lanes = __m256;  // 8 float32 lanes
constexpr int64_t kLanes = 8;
inline Lanes zero() { return _mm256_setzero_ps(); }
inline Lanes floats(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes weights(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p))));
}
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline float lanes_sum(Lanes v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// R rows of x (stride x_stride) against C weight rows (stride cols) of `cols` int8 values:
// sums[c * 4 + r]. Each (row, channel) sum takes the same order for every R and C: two sets
// of lanes over alternate stretches of k, then a last stretch, then one value at a time.
template <int C, int R>
void int8_block(const int8_t* w, const float* x, int64_t x_stride, int64_t cols,
                float* sums) {
  Lanes acc[C][R][2];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = zero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= cols; k += 2 * kLanes) {
    Lanes w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      w0[c] = weights(w + c * cols + k);
      w1[c] = weights(w + c * cols + k + kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const Lanes x0 = floats(x + r * x_stride + k), x1 = floats(x + r * x_stride + k + kLanes);
      for (int c = 0; c < C; ++c) {
        acc[c][r][0] = fma(w0[c], x0, acc[c][r][0]);
        acc[c][r][1] = fma(w1[c], x1, acc[c][r][1]);
      }
    }
  }
  if (k + kLanes <= cols) {
    for (int c = 0; c < C; ++c) {
      const Lanes w0 = weights(w + c * cols + k);
      for (int r = 0; r < R; ++r)
        acc[c][r][0] = fma(w0, floats(x + r * x_stride + k), acc[c][r][0]);
    }
    k += kLanes;
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t t = k; t < cols; ++t)
        tail += static_cast<float>(w[c * cols + t]) * x[r * x_stride + t];
      sums[c * 4 + r] = lanes_sum(acc[c][r][0]) + lanes_sum(acc[c][r][1]) + tail;
    }
}

template <int C>
void int8_rows_of(const int8_t* w, const float* x, int64_t count, int64_t cols, float* sums) {
  switch (count) {
    case 4: int8_block<C, 4>(w, x, cols, cols, sums); break;
    case 3: int8_block<C, 3>(w, x, cols, cols, sums); break;
    case 2: int8_block<C, 2>(w, x, cols, cols, sums); break;
    default: int8_block<C, 1>(w, x, cols, cols, sums);
  }
}

// A few rows of x read the weights once, one row at a time straight through: a CPU's
// prefetchers keep up with that, not with rows read side by side (a 49152 x 576 LM head,
// one row of x, on a Zen 4: 0.9 ms, against 2.2 taking four weight rows at once). Many rows
// reuse each weight from the caches; two weight rows at once then save loads of x.
template <typename Scale>
void int8_rows(const float* x, int64_t rows, int64_t cols, const int8_t* w, const Scale* scale,
               int64_t out, float* y) {
  const int64_t width = rows < kRowsForPairs ? 1 : 2;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    float sums[8];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowsInCache) {
      const int64_t r1 = rows - r0 < kRowsInCache ? rows : r0 + kRowsInCache;
      for (int64_t n = begin; n < end;) {
        const int64_t channels = end - n < width ? 1 : width;
        for (int64_t r = r0; r < r1; r += 4) {
          const int64_t count = r1 - r < 4 ? r1 - r : 4;
          if (channels == 2)
            int8_rows_of<2>(w + n * cols, x + r * cols, count, cols, sums);
          else
            int8_rows_of<1>(w + n * cols, x + r * cols, count, cols, sums);
          for (int64_t c = 0; c < channels; ++c) {
            const float s = static_cast<float>(scale[n + c]);
            for (int64_t i = 0; i < count; ++i) y[(r + i) * out + n + c] = sums[c * 4 + i] * s;
          }
        }
        n += channels;
      }
    }
  });
}

// x float32 [rows, in]; weight int8 [out, in]; scale float32 or bfloat16 [out].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar &&
                  weight.size(1) == x.size(1),
              "weight: int8 [out, ", x.size(1), "]");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0) &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "scale: float32 or bfloat16 [", weight.size(0), "]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), sc = scale.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1), out = weight.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (scale.scalar_type() == at::kFloat)
    int8_rows(xc.data_ptr<float>(), rows, cols, wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
              out, y.data_ptr<float>());
  else
    int8_rows(xc.data_ptr<float>(), rows, cols, wc.data_ptr<int8_t>(),
              sc.data_ptr<at::BFloat16>(), out, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_cpu, CPU, m) {
  m.impl("int8_linear", int8_linear);
}
