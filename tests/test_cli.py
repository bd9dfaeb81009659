"""`infer generate` and `infer chat` on the embedded default model."""

from __future__ import annotations

import io

from engine_fixtures import make_llm

from infer import SamplingParams, cli


def _patch_llm(monkeypatch):
    """Reuse the session's loaded SmolLM2 weights instead of loading them again."""
    import infer.llm

    monkeypatch.setattr(infer.llm, "LLM", lambda **config: make_llm(**{
        k: v for k, v in config.items() if k not in ("model", "device")}))


def test_generate_streams_the_greedy_completion(monkeypatch, capsys):
    _patch_llm(monkeypatch)
    code = cli.main(["generate", "The capital of France is", "--max-tokens", "8",
                     "--num-blocks", "64"])
    assert code == 0
    expected = make_llm(num_blocks=64).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_chat_answers_each_turn(monkeypatch, capsys):
    _patch_llm(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\nAnd 3+3?\n\n"))
    assert cli.main(["chat", "--max-tokens", "24", "--num-blocks", "64"]) == 0
    lines = [line for line in capsys.readouterr().out.split("\n") if line.strip()]
    assert len(lines) >= 2
    assert "4" in lines[0]


def test_bad_flag_combination_is_a_clear_error(capsys):
    code = cli.main(["generate", "hi", "--kv-cache", "contiguous"])
    assert code == 2
    assert "prefix_caching" in capsys.readouterr().err
