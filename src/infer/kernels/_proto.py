import triton
import triton.language as tl


@triton.jit
def _proto_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if MODE == 0:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_rows + k0 + rk[None, :]).to(tl.float32)
            acc += w * tl.load(x_ptr + k0 + rk).to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_rows + k0 + rk[None, :]).to(tl.float16)
            x = (tl.load(x_ptr + k0 + rk).to(tl.float32) * (1.0 / 256)).to(tl.float16)
            acc += w * x[None, :]
        y = tl.sum(acc.to(tl.float32), axis=1) * 256.0
    y *= tl.load(s_ptr + rn)
    tl.store(y_ptr + rn, y.to(tl.bfloat16))
