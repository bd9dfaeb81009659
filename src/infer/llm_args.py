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
