// Decode attention on the CPU over the paged KV cache, one call for a step's layer: every
// sequence's one new query against its keys and values read through its block table, in
// float32 (softmax by its maximum, as torch's reference path computes it); with a sliding
// window only the last `window` keys, with a softcap each score `c tanh(score / c)`. The
// cache holds float32, or e4m3 bytes (an FP8 cache, `kv_dtype.py`), each key and value row
// made float32 once for the whole GQA group (`e4m3_to_float`). Built into the CPU extension
// (`cpu_extension.available`); threads: torch's intra-op pool, one (sequence, kv head) pair
// at a time.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// a . b over n floats (eight lanes at a time; the build targets AVX2 at least)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float total = _mm_cvtss_f32(h);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// e4m3 bytes as floats, eight at a time without a table: each byte sign-extended to 16
// bits, shifted by 7 and masked is the float16 of its value times 2^-8 (the sign at bit 15,
// exponent and mantissa at bits 13..7; e4m3's subnormals are float16 subnormals), which
// F16C makes float32; times 256 is the value, exactly. (The bytes 0x7F and 0xFF, e4m3's
// NaN, which no store writes, read as +-480.)
inline void e4m3_to_float(const uint8_t* bytes, float* out, int64_t n) {
  const __m128i mask = _mm_set1_epi16(static_cast<short>(0xBF80));
  const __m256 undo = _mm256_set1_ps(256.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(bytes + i)));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(wide, 7), mask);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(half), undo));
  }
  for (; i < n; ++i) {
    const uint16_t wide = static_cast<uint16_t>(static_cast<int8_t>(bytes[i]));
    const uint16_t half = static_cast<uint16_t>((wide << 7) & 0xBF80);
    out[i] = _cvtsh_ss(half) * 256.f;
  }
}

// A cache row of `dim` values as floats: a float32 row is itself, an e4m3 one is decoded
// into `buffer`.
inline const float* row_of(const float* row, float*, int64_t) { return row; }
inline const float* row_of(const uint8_t* row, float* buffer, int64_t dim) {
  e4m3_to_float(row, buffer, dim);
  return buffer;
}

// q [seqs, heads, dim], caches [blocks, block_size, kv_heads, dim] (float32, or uint8: e4m3
// bytes; contiguous), block_tables [seqs, >= blocks a sequence holds] int32, seq_lens [seqs]
// int32 (each >= 1); window 0 / softcap 0: none. Returns [seqs, heads, dim].
template <typename T>
at::Tensor paged_decode_of(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap) {
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "q's heads / dim vs the cache's");
  TORCH_CHECK(block_tables.size(0) == seqs && seq_lens.size(0) == seqs, "one row a sequence");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::zeros({seqs, heads, dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, table_width = tables.size(1);
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, tops(group), inverses(group), buffer(dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / kv_heads, kvh = pair % kv_heads;
      const int64_t len = lp[seq];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= table_width,
                  "sequence ", seq, ": ", len, " keys beyond its block table");
      const int32_t* table = tp + seq * table_width;
      const int64_t first = window > 0 && len > window ? len - window : 0, keys = len - first;
      const float* q0 = qp + (seq * heads + kvh * group) * dim;  // the group's heads
      float* o0 = op + (seq * heads + kvh * group) * dim;
      scores.resize(group * keys);  // [group, keys]
      for (int64_t g = 0; g < group; ++g) tops[g] = -INFINITY;
      for (int64_t t = first; t < len; ++t) {
        const float* k = row_of(kp + table[t / block_size] * block_stride +
                                    (t % block_size) * token_stride + kvh * dim,
                                buffer.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          float score = dot(q0 + g * dim, k, dim) * s;
          if (cap > 0.f) score = std::tanh(score / cap) * cap;
          scores[g * keys + t - first] = score;
          tops[g] = score > tops[g] ? score : tops[g];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * keys;
        float total = 0.f;
        for (int64_t i = 0; i < keys; ++i) total += (row[i] = std::exp(row[i] - tops[g]));
        inverses[g] = 1.f / total;
      }
      for (int64_t t = first; t < len; ++t) {
        const float* v = row_of(vp + table[t / block_size] * block_stride +
                                    (t % block_size) * token_stride + kvh * dim,
                                buffer.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * keys + t - first] * inverses[g];
          float* o = o0 + g * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t window,
                        double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: float32 [seqs, heads, dim]");
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && (type == at::kFloat || type == at::kByte) &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == type &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches: float32 or uint8 (e4m3 bytes) [blocks, block_size, kv_heads, dim], "
              "contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables, seq_lens: int32");
  return type == at::kFloat
             ? paged_decode_of<float>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      window, softcap)
             : paged_decode_of<uint8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                        window, softcap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_cpu, CPU, m) {
  m.impl("paged_decode", paged_decode);
}
