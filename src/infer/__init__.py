"""infer: an LLM inference and serving engine on PyTorch.

`from infer import LLM, SamplingParams` (imported lazily, so `infer.loader` and the CLI
stay light).
"""

from __future__ import annotations

import importlib

from infer.logs import configure_logging

configure_logging()

_EXPORTS = {
    "LLM": "infer.llm",
    "SamplingParams": "infer.sampling_params",
    "EngineConfig": "infer.engine.config",
    "RequestOutput": "infer.engine.outputs",
    "CompletionOutput": "infer.engine.outputs",
    "RequestOutputKind": "infer.sampling_params",
    "StructuredOutputsParams": "infer.sampling_params",
    "TextPrompt": "infer.inputs",
    "TokensPrompt": "infer.inputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
