"""The command line explains itself: positional models, --version, every engine flag's
help and choices (from EngineConfig's field metadata), and only commands that exist."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata

import pytest

from infer import cli
from infer.cli import build_parser, engine_config
from infer.engine.config import (
    BACKENDS,
    BATCHING_MODES,
    DTYPES,
    GEMV_FORMS,
    KV_CACHE_DTYPES,
    KV_CACHES,
    MIXED_STEP_GRAPHS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
)

CHOICES = {"dtype": DTYPES, "batching_mode": BATCHING_MODES, "kv_cache": KV_CACHES,
           "kv_cache_dtype": KV_CACHE_DTYPES,
           "attention_backend": BACKENDS, "kernel_backend": BACKENDS,
           "mixed_step_graphs": MIXED_STEP_GRAPHS, "quantization": QUANTIZATIONS,
           "draft_quantization": QUANTIZATIONS,
           "speculative_method": SPECULATIVE_METHODS, "gemv_form": GEMV_FORMS}


def _subparser(name: str, *more: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for step in (name, *more):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[step]
    return parser


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {a.dest: a for a in group._group_actions}


def test_every_field_has_help_saying_what_none_means():
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata["help"]
        assert text.strip(), f.name
        if f.default is None:
            assert "default" in text, f"{f.name}: help must say what None means"


@pytest.mark.parametrize("command", [("serve",), ("generate",), ("chat",),
                                     ("bench", "offline")])
def test_every_field_is_a_flag_of_the_engine_group_with_its_choices(command):
    actions = _engine_actions(_subparser(*command))
    assert set(actions) == set(EngineConfig.field_names())
    for name, action in actions.items():
        assert action.help, name
        assert action.choices == CHOICES.get(name), name
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert {n for n, f in fields.items() if f.metadata["choices"]} == set(CHOICES)


@pytest.mark.parametrize(("flag", "value", "listed"), [
    ("--dtype", "float8", "bfloat16"), ("--quantization", "int3", "fp8"),
    ("--device", "tpu", "cuda:N"), ("--device", "cuda:x", "cuda:N"),
    ("--kv-cache", "ring", "contiguous")])
def test_a_wrong_choice_is_refused_by_argparse_with_the_list(capsys, flag, value, listed):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err
    assert listed in err


def test_device_takes_an_index():
    assert engine_config(build_parser().parse_args(["serve", "--device", "cuda:1"])
                         ).device == "cuda:1"


@pytest.mark.parametrize("argv", [["serve", "m.gguf"], ["serve", "--port", "9", "m.gguf"],
                                  ["serve", "m.gguf", "--port", "9"],
                                  ["serve", "--model", "m.gguf"],
                                  ["serve", "m.gguf", "--model", "m.gguf"],
                                  ["chat", "m.gguf"], ["chat", "--model", "m.gguf"],
                                  ["generate", "a prompt", "--model", "m.gguf"]])
def test_the_model_is_positional_or_a_flag(argv):
    args = build_parser().parse_args(argv)
    assert engine_config(args).model == "m.gguf"
    if argv[0] == "generate":
        assert args.prompt == "a prompt"


def test_no_model_is_the_default_one():
    assert engine_config(build_parser().parse_args(["serve"])).model is None


def test_two_different_models_are_a_clear_error(capsys):
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(ValueError, match="two models given"):
        engine_config(args)
    assert cli.main(["chat", "a.gguf", "--model", "b.gguf"]) == 2
    err = capsys.readouterr().err
    assert "a.gguf" in err
    assert "b.gguf" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"infer {importlib.metadata.version('infer')}"


def test_help_lists_the_commands_that_exist(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"serve", "generate", "chat", "bench"}
    for name in sub.choices:
        assert name in out
    assert set(_subparser("bench")._actions[-1].choices) == {"offline", "serve"}


def test_serve_help_groups_the_engine_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "\nengine:\n" in out
    assert "\nserver:\n" in out
    assert "capped at 8192" in out  # --max-model-len's None
    assert "{auto,float32,bfloat16,float16}" in out
    assert "SmolLM2-135M-Instruct" in out


def test_vllm_speculative_config_flag_maps_onto_the_engine_flags(capsys):
    parse = build_parser().parse_args
    config = engine_config(parse(["serve", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5}']))
    assert (config.speculative_method, config.num_speculative_tokens, config.ngram_max) == (
        "ngram", 3, 5)
    config = engine_config(parse(["generate", "hi", "--speculative-config",
                                  '{"model": "draft-dir", "quantization": "int8"}']))
    assert (config.speculative_method, config.draft_model, config.draft_quantization) == (
        "draft", "draft-dir", "int8")
    with pytest.raises(ValueError, match="give --speculative-config or --num-speculative-tokens"):
        engine_config(parse(["serve", "--num-speculative-tokens", "2", "--speculative-config",
                             '{"method": "ngram", "num_speculative_tokens": 3}']))
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        engine_config(parse(["serve", "--speculative-config", '{"method": "eagle"}']))
    for bad in ("{method: ngram}", "[1]"):
        with pytest.raises(SystemExit):
            parse(["serve", "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err
