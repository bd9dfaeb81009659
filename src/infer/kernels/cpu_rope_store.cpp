// A layer's RoPE and KV store on the CPU in one call, where torch's path takes about twenty
// operations (each a few microseconds of dispatch): q and k rotated neox-style at each
// token's position (the first and second halves of a head as the pairs,
//   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)),
// the rotated k and v written to the paged caches at the tokens' slots (a slot of -1 is
// not written), the rotated q returned. float32 throughout, but for an FP8 cache
// (`kv_dtype.py`), which takes e4m3 bytes rounded as torch rounds them; threads: torch's
// intra-op pool, over tokens.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * c[i] - b * s[i];
    out[i + half] = b * c[i] + a * s[i];
  }
}

// x as an e4m3 byte, saturated at +-448 and rounded to nearest even (torch's rounding, as
// `kv_store.cache_values` computes it): a normal magnitude keeps float32's exponent and top
// 3 mantissa bits, rounded by adding 2^19 - 1 plus the kept last bit, rebiased from 127 to
// 7; one below 2^-6 is its count of 2^-9.
inline uint8_t to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const float a = std::fabs(x) < 448.f ? std::fabs(x) : 448.f;
  uint32_t magnitude;
  std::memcpy(&magnitude, &a, 4);
  const uint32_t code =
      a < 0.015625f ? static_cast<uint32_t>(std::nearbyint(a * 512.f))
                    : ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3);
  return static_cast<uint8_t>(((bits >> 24) & 0x80) | code);
}

// k rotated into a float32 cache row; into an e4m3 one through `buffer`.
inline void rotate_into(const float* x, const float* c, const float* s, int64_t half,
                        float* row, float*) {
  rotate(x, c, s, half, row);
}
inline void rotate_into(const float* x, const float* c, const float* s, int64_t half,
                        uint8_t* row, float* buffer) {
  rotate(x, c, s, half, buffer);
  for (int64_t i = 0; i < 2 * half; ++i) row[i] = to_e4m3(buffer[i]);
}

// `n` floats into a cache row: as they are, or as e4m3 bytes.
inline void store_row(const float* x, float* row, int64_t n) {
  std::memcpy(row, x, n * sizeof(float));
}
inline void store_row(const float* x, uint8_t* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) row[i] = to_e4m3(x[i]);
}

// heads adjacent, each `dim` contiguous floats; any stride between tokens (a view of the
// fused q/k/v projection's output).
void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t dim) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.size(0) == tokens &&
                  t.size(2) == dim && t.stride(2) == 1 && t.stride(1) == dim,
              name, ": float32 [tokens, heads, ", dim, "], heads adjacent");
}

// q [T, H, D], k and v [T, KH, D]; cos, sin [positions, D / 2]; positions, slots int64 [T];
// caches float32 or uint8 (e4m3 bytes) [blocks, block_size, KH, D], contiguous. Returns q
// rotated, [T, H, D].
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slots,
                      const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  check_heads(q, "q", tokens, dim);
  const int64_t kv_heads = k.size(1), half = dim / 2;
  check_heads(k, "k", tokens, dim);
  check_heads(v, "v", tokens, dim);
  TORCH_CHECK(v.size(1) == kv_heads, "v: k's ", kv_heads, " heads");
  TORCH_CHECK(dim % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos, sin: float32 [positions, ", half, "], contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slots.numel() == tokens,
              "positions, slots: int64 [", tokens, "]");
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  (type == at::kFloat || type == at::kByte) && v_cache.scalar_type() == type &&
                  k_cache.size(2) == kv_heads && k_cache.size(3) == dim &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches: float32 or uint8 (e4m3 bytes) [blocks, block_size, ", kv_heads, ", ",
              dim, "], contiguous");
  const at::Tensor pos = positions.contiguous(), slot = slots.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  const int64_t cache_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " outside the RoPE table");
    TORCH_CHECK(sp[t] >= -1 && sp[t] < cache_slots, "slot ", sp[t], " outside the cache");
  }
  at::Tensor out = at::empty({tokens, heads, dim}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), row = kv_heads * dim;
  auto run = [&](auto* kc, auto* vc) {
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(dim);
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pp[t] * half;
        const float* s = snp + pp[t] * half;
        for (int64_t h = 0; h < heads; ++h)
          rotate(qp + t * qs + h * dim, c, s, half, op + (t * heads + h) * dim);
        if (sp[t] < 0) continue;
        for (int64_t h = 0; h < kv_heads; ++h) {
          rotate_into(kp + t * ks + h * dim, c, s, half, kc + sp[t] * row + h * dim,
                      buffer.data());
          store_row(vp + t * vs + h * dim, vc + sp[t] * row + h * dim, dim);
        }
      }
    });
  };
  if (type == at::kFloat)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    run(k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_cpu, m) {
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_cpu, CPU, m) {
  m.impl("rope_store", rope_store);
}
