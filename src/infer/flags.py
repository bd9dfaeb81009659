"""The command line's engine and sampling flags: one engine flag per EngineConfig field,
its help and choices read from the field's metadata (engine/config.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from infer.engine.config import DEVICES, EngineConfig, is_device


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--max-num-seqs 8`, `--no-prefix-caching`), in an
    "engine" group."""
    group = parser.add_argument_group("engine", "EngineConfig fields (also keywords of "
                                      "infer.LLM); invalid combinations fail at start-up")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"]
        if f.default is not None:
            shown = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
            text += f" (default: {shown})"
        text = text.replace("%", "%%")
        hint = hints[f.name]
        if bool in (hint, *typing.get_args(hint)):  # `bool | None`: None is "by the device"
            action = group.add_argument(flag, dest=f.name, default=f.default,
                                        action=argparse.BooleanOptionalAction)
            action.help = text  # set after: some Pythons append the default themselves
            continue
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if f.name == "device":
            group.add_argument(flag, dest=f.name, type=_device, default=f.default,
                               metavar="{" + ",".join(DEVICES) + "}", help=text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=text,
                               choices=f.metadata["choices"])
    vllm = parser.add_argument_group("vLLM's spellings", "mapped onto the engine flags")
    vllm.add_argument("--speculative-config", dest="speculative_config", type=_json_object,
                      default=None, metavar="JSON",
                      help="vLLM's speculative_config as JSON, e.g. '{\"method\": \"ngram\", "
                      "\"num_speculative_tokens\": 4}' or '{\"model\": DRAFT, "
                      "\"num_speculative_tokens\": 4}' (methods ngram and draft_model; keys "
                      "num_speculative_tokens, prompt_lookup_min/max, model, quantization)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _device(text: str) -> str:
    if not is_device(text):
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(DEVICES)})")
    return text


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`infer serve MODEL`, as `vllm serve MODEL`: the same as --model, which also works."""
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (give one or the other)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.field_names()}
    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if values["model"] is not None and values["model"] != positional:
            raise ValueError(f"two models given: {positional!r} (positional) and "
                             f"--model {values['model']!r}; give one")
        values["model"] = positional
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        from infer.llm_args import speculative_flags

        flags = speculative_flags(spec)
        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        given = sorted("--" + n.replace("_", "-") for n in flags if values[n] != defaults[n])
        if given:
            raise ValueError(f"give --speculative-config or {', '.join(given)}, not both")
        values.update(flags)
    return EngineConfig(**values)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256,
                       help="most tokens to generate per reply (default: 256)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 samples greedily (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample from the smallest set of tokens whose probabilities add "
                       "up to this (default: 1, all)")
    group.add_argument("--top-k", type=int, default=0,
                       help="sample from the k most likely tokens (default: 0, all)")


def sampling_params(args: argparse.Namespace, **extra):
    from infer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, **extra)
