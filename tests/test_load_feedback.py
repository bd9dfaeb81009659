"""What start-up says: a progress bar while the weights load (on a terminal), and one
line once the engine is ready naming what was chosen."""

from __future__ import annotations

import io
import logging

from tiny_model import tiny_model_dir

from infer.engine.llm_engine import LLMEngine
from infer.loader import load_hf_dir


def test_the_ready_line_says_what_was_chosen(caplog):
    caplog.set_level(logging.INFO, logger="infer")
    LLMEngine(model=str(tiny_model_dir()), device="cpu", num_blocks=64, block_size=8,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=256)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]
    assert len(ready) == 1
    line = ready[0]
    for part in ("on cpu, float32", "quantization none",
                 "KV cache 512 tokens (64 blocks x 8, float32)",
                 "attention torch, kernels torch", "CUDA graphs off", "max_num_seqs=4",
                 "max_num_batched_tokens=256", "max_model_len=128", tiny_model_dir().name):
        assert part in line, (part, line)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_on_a_terminal_only(monkeypatch):
    for stderr, shown in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stderr)
        load_hf_dir(tiny_model_dir())
        assert ("Loading safetensors checkpoint" in stderr.getvalue()) == shown
        if shown:
            assert "100%" in stderr.getvalue()
