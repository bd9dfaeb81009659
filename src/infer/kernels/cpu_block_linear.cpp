// One-row (decode) linear layers on x86 CPUs with AVX2, weights in GGUF-style blocks of 32
// along the input dim, read as stored:
//   q4_1: {fp16 d, fp16 m, 16 bytes of nibbles}  w = q * d + m, q in 0..15; byte j holds
//         element j (low nibble) and element j + 16 (high nibble), as GGUF's Q4_0/Q4_1
//   q8_0: {fp16 d, 32 int8}                         w = q * d
// x is rounded to int8 per block of 32 (scale max|x| / 127) and each block's dot product
// taken in integers, as llama.cpp's CPU kernels do; a q4_1 block's `m` term uses x's exact
// float sum. Outputs are float32. Threads: torch's intra-op pool (at::parallel_for).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4Bytes = 20;  // 2 + 2 + 16
constexpr int64_t kQ8Bytes = 34;  // 2 + 32

struct QuantizedRows {  // x rounded per block: int8 values, scales, exact float sums
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t cols) {
  const int64_t blocks = cols / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * cols), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks)};
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 amax = _mm256_setzero_ps();
    __m256 total = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < kBlock; i += 8) {
      __m256 v = _mm256_loadu_ps(xb + i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
      total = _mm256_add_ps(total, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.f;
    for (float l : lanes) m = l > m ? l : m;
    _mm256_store_ps(lanes, total);
    float s = 0.f;
    for (float l : lanes) s += l;
    const float d = m / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    int8_t* qb = out.q.data() + b * kBlock;
    for (int i = 0; i < kBlock; i += 8) {
      __m256i r = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      alignas(32) int32_t v[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(v), r);
      for (int j = 0; j < 8; ++j) qb[i + j] = static_cast<int8_t>(v[j]);
    }
    out.scale[b] = d;
    out.sum[b] = s;
  }
  return out;
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int32 sums of u[i] * s[i] over four bytes each (u unsigned, s signed).
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 32 int8 values of x dotted with 32 unsigned 4-bit weights `q`, times `scale`, plus `acc`.
inline __m256 scaled_dot(__m256i q, const int8_t* x, float scale, __m256 acc) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(q, v)), _mm256_set1_ps(scale), acc);
}

inline __m256i q4_values(const uint8_t* block) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                          _mm256_set1_epi8(0x0F));
}

// The dot products of one weight row with x's rows r0 .. r0 + R - 1, each block of the
// weight decoded once for all R, written to out[0], out[out_stride], ... Two accumulators
// per row (even and odd blocks) so that consecutive blocks' FMAs do not wait on each other.
template <int R>
void q4_1_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks,
               float* out, int64_t out_stride) {
  __m256 acc[2][R];
  float offset[2][R];
  for (int r = 0; r < R; ++r) {
    acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    offset[0][r] = offset[1][r] = 0.f;
  }
  const int8_t* xq = x.q.data() + r0 * blocks * kBlock;
  const float* xd = x.scale.data() + r0 * blocks;
  const float* xs = x.sum.data() + r0 * blocks;
  auto step = [&](int64_t b, const uint8_t* block, __m256* sums, float* offsets) {
    const __m256i q = q4_values(block);
    const float d = fp16(block), m = fp16(block + 2);
    for (int r = 0; r < R; ++r) {
      const int64_t xb = r * blocks + b;
      sums[r] = scaled_dot(q, xq + xb * kBlock, d * xd[xb], sums[r]);
      offsets[r] += m * xs[xb];
    }
  };
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2, w += 2 * kQ4Bytes) {
    step(b, w, acc[0], offset[0]);
    step(b + 1, w + kQ4Bytes, acc[1], offset[1]);
  }
  if (b < blocks) step(b, w, acc[0], offset[0]);
  for (int r = 0; r < R; ++r)
    out[r * out_stride] = horizontal_sum(_mm256_add_ps(acc[0][r], acc[1][r])) + offset[0][r] +
                          offset[1][r];
}

template <int R>
void q8_0_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks,
               float* out, int64_t out_stride) {
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  const int8_t* xq = x.q.data() + r0 * blocks * kBlock;
  const float* xd = x.scale.data() + r0 * blocks;
  auto step = [&](int64_t b, const uint8_t* block, __m256* sums) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    // u8 x s8 products: |q| against x carrying q's sign (q = -128 has no |q| in int8, but
    // read unsigned its magnitude is right)
    const __m256i magnitude = _mm256_sign_epi8(q, q);
    const float d = fp16(block);
    for (int r = 0; r < R; ++r) {
      const int64_t xb = r * blocks + b;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + xb * kBlock));
      sums[r] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(dot_u8_s8(magnitude, _mm256_sign_epi8(v, q))),
          _mm256_set1_ps(d * xd[xb]), sums[r]);
    }
  };
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2, w += 2 * kQ8Bytes) {
    step(b, w, acc[0]);
    step(b + 1, w + kQ8Bytes, acc[1]);
  }
  if (b < blocks) step(b, w, acc[0]);
  for (int r = 0; r < R; ++r)
    out[r * out_stride] = horizontal_sum(_mm256_add_ps(acc[0][r], acc[1][r]));
}

using RowsKernel = void (*)(const uint8_t*, const QuantizedRows&, int64_t, int64_t, float*,
                            int64_t);

// x [rows, in] times the blocks' weight [out, in] transposed; K<n> takes n rows of x.
template <RowsKernel K1, RowsKernel K2, RowsKernel K3, RowsKernel K4>
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t block_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte,
              "weight: uint8 [out, blocks * bytes]");
  const int64_t rows = x.size(0), cols = x.size(1), out = weight.size(0);
  TORCH_CHECK(cols % kBlock == 0 && weight.size(1) == cols / kBlock * block_bytes,
              "weight's blocks do not match x's ", cols, " columns");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const QuantizedRows xq = quantize_rows(xc.data_ptr<float>(), rows, cols);
  at::Tensor y = at::empty({rows, out}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const int64_t blocks = cols / kBlock, row_bytes = blocks * block_bytes;
  constexpr RowsKernel kernels[] = {K1, K2, K3, K4};
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t count = rows - r < 4 ? rows - r : 4;
        kernels[count - 1](wp + n * row_bytes, xq, r, blocks, yp + r * out + n, out);
      }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weight) {
  return block_linear<q4_1_rows<1>, q4_1_rows<2>, q4_1_rows<3>, q4_1_rows<4>>(x, weight,
                                                                            kQ4Bytes);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& weight) {
  return block_linear<q8_0_rows<1>, q8_0_rows<2>, q8_0_rows<3>, q8_0_rows<4>>(x, weight,
                                                                            kQ8Bytes);
}

}  // namespace

TORCH_LIBRARY(infer_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_cpu, CPU, m) {
  m.impl("q4_1_linear", q4_1_linear);
  m.impl("q8_0_linear", q8_0_linear);
}
