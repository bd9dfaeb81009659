"""`LLM(...)`'s keyword arguments: EngineConfig's fields, and the vLLM names a script
copied from vLLM's docs passes, mapped onto them or accepted where they change nothing
here. Anything else is refused by name, with the closest known names."""

from __future__ import annotations

import difflib
from typing import Any

from infer.engine.config import EngineConfig

# vLLM's name -> EngineConfig's, where they mean the same.
RENAMED = {"enable_prefix_caching": "prefix_caching",
           "enable_chunked_prefill": "chunked_prefill"}
# Accepted where they ask for what infer does anyway (None or this value), refused else.
NO_OP = {
    "trust_remote_code": None,  # any value: infer runs its own model code, never a checkpoint's
    "pipeline_parallel_size": 1,
    "tokenizer": None,  # the model's own tokenizer
    "tokenizer_mode": "auto",
    "disable_log_stats": None,
    "revision": None,
    "download_dir": None,
    "swap_space": None,  # preempted sequences are recomputed, never swapped
    "max_seq_len_to_capture": None,
}
# vLLM's `speculative_config`: each `method` it takes here -> EngineConfig's
# speculative_method, and that method's keys -> EngineConfig's fields.
VLLM_SPECULATIVE = {
    "ngram": ("ngram", {"num_speculative_tokens": "num_speculative_tokens",
                        "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}),
    "draft_model": ("draft", {"num_speculative_tokens": "num_speculative_tokens",
                              "model": "draft_model", "quantization": "draft_quantization"}),
}


def engine_config(model: str | None, kwargs: dict[str, Any]) -> EngineConfig:
    """The EngineConfig for `LLM(model, **kwargs)`; ValueError for an argument infer does
    not know or cannot honour."""
    config: dict[str, Any] = {}
    known = set(EngineConfig.field_names())
    for name, value in kwargs.items():
        if name in known:
            config[name] = value
        elif name in RENAMED:
            config[RENAMED[name]] = value
        elif name == "speculative_config":
            speculative = speculative_flags(value)
            twice = set(speculative) & set(kwargs)
            if twice:
                raise ValueError(f"give speculative_config or {', '.join(sorted(twice))}, "
                                 "not both")
            config.update(speculative)
        elif name == "enforce_eager":
            if not isinstance(value, bool):
                raise ValueError(f"enforce_eager must be True or False, got {value!r}")
            config["cuda_graphs"] = not value
        elif name in NO_OP:
            wanted = NO_OP[name]
            if wanted is not None and value not in (None, wanted):
                raise ValueError(f"{name}={value!r} is not supported (only {wanted!r})")
            if name == "tokenizer" and value is not None and value != model:
                raise ValueError("a tokenizer other than the model's own is not supported "
                                 f"(tokenizer={value!r})")
        else:
            close = difflib.get_close_matches(name, [*known, *RENAMED, *NO_OP,
                                                     "enforce_eager"], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"LLM() got an unknown argument {name!r}{hint} (EngineConfig's "
                             "fields are the arguments; see infer.EngineConfig)")
    if "enforce_eager" in kwargs and "cuda_graphs" in kwargs:
        raise ValueError("give enforce_eager or cuda_graphs, not both")
    return EngineConfig(model=model, **config)


def speculative_flags(spec: dict[str, Any] | None) -> dict[str, Any]:
    """EngineConfig's speculative fields for vLLM's `speculative_config` dict: the
    `ngram` and `draft_model` methods (a `model` alone means a draft model)."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in VLLM_SPECULATIVE:
        raise ValueError(f"speculative_config method {method!r} is not supported; supported: "
                         f"{', '.join(VLLM_SPECULATIVE)} (and EngineConfig's "
                         "speculative_method='self')")
    ours, fields = VLLM_SPECULATIVE[method]
    flags: dict[str, Any] = {"speculative_method": ours}
    for key, value in spec.items():
        if key == "method":
            continue
        if key not in fields:
            raise ValueError(f"speculative_config key {key!r} is not supported with method "
                             f"{method!r}; supported: method, {', '.join(fields)}")
        flags[fields[key]] = value
    return flags
