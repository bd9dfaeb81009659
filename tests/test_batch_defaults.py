"""max_num_seqs and max_num_batched_tokens, when not given: sized to the device (a CPU keeps
64 and 2,048; a GPU of 70 GiB or more gets 256 and 16,384, a smaller one 256 and 8,192),
what the user sets kept, and the server's own choice."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from infer.cli import build_parser, serve_engine_config
from infer.engine.batch_defaults import fit_batch_to_device
from infer.engine.config import EngineConfig


def _gpu(monkeypatch, gib: int) -> torch.device:
    props = types.SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return torch.device("cuda")


@pytest.mark.parametrize(("gib", "expected"), [(80, (256, 16384)), (141, (256, 16384)),
                                               (24, (256, 8192)), (40, (256, 8192))])
def test_a_gpu_gets_a_batch_for_its_class(monkeypatch, gib, expected):
    config = fit_batch_to_device(EngineConfig(), _gpu(monkeypatch, gib), 8192)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == expected


def test_a_cpu_keeps_small_steps_and_what_the_user_sets_is_kept(monkeypatch, caplog):
    with caplog.at_level("INFO", logger="infer.engine.batch_defaults"):
        config = fit_batch_to_device(EngineConfig(), torch.device("cpu"), 8192)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 2048)
    assert "max_num_seqs=64, max_num_batched_tokens=2048" in caplog.text
    assert "on a CPU" in caplog.text
    gpu = _gpu(monkeypatch, 80)
    config = fit_batch_to_device(EngineConfig(max_num_seqs=8), gpu, 8192)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (8, 16384)
    config = fit_batch_to_device(EngineConfig(max_num_batched_tokens=512), gpu, 8192)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 512)
    given = EngineConfig(max_num_seqs=3, max_num_batched_tokens=100)
    assert fit_batch_to_device(given, gpu, 8192) is given


def test_unchunked_prefills_get_a_budget_that_holds_the_longest_prompt():
    config = fit_batch_to_device(EngineConfig(chunked_prefill=False), torch.device("cpu"), 4096)
    assert config.max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="chunked_prefill=False needs"):
        EngineConfig(chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)


@pytest.mark.parametrize("value", [0, -1])
def test_a_batch_size_that_is_not_positive_is_refused(value):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=value)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_server_keeps_small_steps_on_any_device(device):
    args = build_parser().parse_args(["serve", "--device", device])
    assert serve_engine_config(args).max_num_batched_tokens == 2048
    args = build_parser().parse_args(["serve", "--device", device,
                                      "--max-num-batched-tokens", "4096"])
    assert serve_engine_config(args).max_num_batched_tokens == 4096


def test_the_engine_reports_what_it_chose():
    from engine_fixtures import make_llm

    llm = make_llm(num_blocks=64)
    assert (llm.engine.info.max_num_seqs, llm.engine.info.max_num_batched_tokens) == (64, 2048)


@pytest.mark.parametrize("configure", ["1", "0"])
def test_the_choice_is_on_stderr_unless_logging_is_the_applications(configure):
    from tiny_model import tiny_model_dir

    model = str(tiny_model_dir())
    script = (f"from infer import LLM; LLM(model={model!r}, device='cpu', num_blocks=64, "
              "max_model_len=128)")
    env = {**os.environ, "INFER_CONFIGURE_LOGGING": configure}
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, check=True).stderr
    line = "INFO infer: max_num_seqs=64, max_num_batched_tokens=2048, the defaults on a CPU"
    assert (line in err) == (configure == "1"), err
