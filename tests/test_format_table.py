"""`benchmarks/format_table.py`: the one table of decode steps by format, from hand-made
`decode.py` and `llamacpp_cuda.py` JSONs (ratios, tok/s and GB computed by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import benchmark_script
import pytest


def _format_table():
    return benchmark_script.load("format_table")


def _row(batch: int, step_ms: float, **extra) -> dict:
    return dict(batch=batch, step_ms=step_ms, weight_MB=1500.0, kv_MB=25.0, frac_copy=0.5,
                **extra)


def _ours(batch: int, step_ms: float, model: str = "llama-3.1-8b") -> dict:
    return _row(batch, step_ms, engine="infer", model=model)


def _write(tmp_path: Path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(dict(env=dict(infer_commit="0123456789abc"), rows=rows)))
    return str(path)


def test_each_format_is_timed_against_the_first_at_its_batch(tmp_path, capsys):
    bf16 = _write(tmp_path, "bf16.json", [_ours(1, 1.5, "llama-3.2-1b"), _ours(1, 5.0),
                                          _ours(32, 8.0),
                                          _row(1, 1.0, engine="hf", model="llama-3.1-8b")])
    fp8_a = _write(tmp_path, "fp8_a.json", [_ours(1, 2.5)])
    fp8_b = _write(tmp_path, "fp8_b.json", [_ours(1, 9.9), _ours(32, 6.4)])
    peer = _write(tmp_path, "llamacpp.json", [
        _row(1, 0.5, tool="llama-bench", mix="Q4_K_M"),  # tg128: not our protocol
        _row(1, 4.0, tool="llama-batched-bench", mix="Q4_K_M"),
        _row(1, 3.0, tool="llama-batched-bench", mix="Q8_0")])
    _format_table().main(["--batches", "1", "32", "--format", f"bf16={bf16}",
                          "--format", f"fp8={fp8_a},{fp8_b}",
                          "--format", f"llama.cpp Q4_K_M={peer}#Q4_K_M"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    got = {(r[0].lstrip("| "), int(r[1])): r[2:7] for r in rows}
    assert got[("bf16", 1)] == ["5.00", "200", "1.52", "50.0 %", "1.00"]
    assert got[("fp8", 1)] == ["2.50", "400", "1.52", "50.0 %", "2.00"]  # the first run's
    assert got[("fp8", 32)] == ["6.40", "5,000", "1.52", "50.0 %", "1.25"]
    assert got[("llama.cpp Q4_K_M", 1)] == ["4.00", "250", "1.52", "50.0 %", "1.25"]
    assert got[("llama.cpp Q4_K_M", 32)][0] == "-" and "not measured" in rows[-1][-1]
    assert "fp8_a.json` (0123456)" in rows[1][-1]


def test_a_format_without_runs_is_refused():
    with pytest.raises(ValueError, match="label=path"):
        _format_table().load("bf16")
