"""Turn what the user typed (`--model`) into a local checkpoint: a HF directory or a GGUF file."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from infer.loader.default_model import default_model_path
from infer.loader.errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a served model needs from a hub repo; pickled weights are never fetched.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    format: str  # "gguf" | "hf_dir"
    name: str  # what /v1/models and logs call it


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    if model is None or str(model) == "":
        path = default_model_path()
        return ModelSource(path, "gguf", "SmolLM2-135M-Instruct")
    text = str(model)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource(path, "gguf", path.stem)
        raise ModelLoadError(
            f"{path}: not a model infer can load (expected a .gguf file or a directory with "
            "config.json and *.safetensors)"
        )
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", ggufs[0].stem)
        return ModelSource(path, "hf_dir", path.name)
    if _HUB_ID.match(text) and not text.startswith((".", "/")):
        return ModelSource(download_from_hub(text), "hf_dir", text)
    raise ModelLoadError(
        f"{text}: no such file or directory (pass a local HF model directory, a .gguf file, "
        "or a hub id like org/name)"
    )


def download_from_hub(repo_id: str) -> Path:
    """Fetch a hub repo's config, tokenizer and safetensors (cached by huggingface_hub)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelLoadError(
            f"{repo_id}: looks like a hub id, but huggingface_hub is not installed "
            "(`pip install huggingface_hub`), or pass a local path instead"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=10))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{repo_id}: cannot download from the hub (offline, and not in the local cache). "
            "Pass a local path instead: a directory with config.json + *.safetensors, or a "
            ".gguf file"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"{repo_id}: hub download failed ({exc})") from None
