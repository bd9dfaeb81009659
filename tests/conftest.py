import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Triton kernels run in the interpreter on the CPU; read when a kernel module is imported,
# so set here, before any test module imports triton. `INFER_TEST_DEVICE=cuda` (a GPU
# run) compiles them for the GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("INFER_TEST_DEVICE") else "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One thread: on a 2-core machine shared with other processes, OpenMP threads that spin
# while waiting make small matmuls 10-50x slower (measured); one thread never oversubscribes.
torch.set_num_threads(1)
# Started as a background job (`bash .ci/run &`), this process ignores SIGINT and so would
# every server a test starts, which then exits 0 on SIGINT (uvicorn stops gracefully and
# re-raises a signal that is ignored): give them Ctrl-C as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def bf16_rounds_to_nearest(monkeypatch):
    """The interpreter (triton 3.9, `interpreter.cast_impl`) converts float32 to bfloat16
    by truncation; GPUs (`cvt.rn.bf16.f32`) and torch round to nearest even. Emulate the
    GPU so that bf16 results can be compared bit for bit on the CPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if not (src == tl.float32 and dst == tl.bfloat16):
            return truncating(data, src, dst, rounding_mode)
        bits = np.ascontiguousarray(data).view(np.uint32)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        return np.where(np.isnan(bits.view(np.float32)), np.uint16(0x7FC0), rounded)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
