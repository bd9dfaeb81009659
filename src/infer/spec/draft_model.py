"""Loading a draft model (`speculative_method="draft"`): any model infer loads, if it
speaks the target's vocabulary."""

from __future__ import annotations

import logging

import torch
from torch import nn

from infer.config import ModelConfig
from infer.loader.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_draft_model(path: str, target_tokenizer: Tokenizer, target_config: ModelConfig,
                     dtype: torch.dtype, device: torch.device, quantization: str = "none",
                     cpu_int8_activations: bool | None = None
                     ) -> tuple[nn.Module, ModelConfig]:
    """The draft model at `path` (a directory or GGUF file) in `quantization`
    (`EngineConfig.quantization`'s choices; `cpu_int8_activations` as for the model); a
    ValueError when its tokenizer maps any token to another id than the target's."""
    from infer.engine.setup import gguf_blocks_of, load_model_and_tokenizer
    from infer.quantization import quantize_model

    model, config, tokenizer, _ = load_model_and_tokenizer(path, dtype, device, quantization)
    check_same_vocabulary(target_tokenizer, tokenizer, path)
    in_effect = quantize_model(model, quantization, gguf_blocks_of(path, config, quantization),
                               cpu_int8_activations)
    log.info("draft model %s: quantization %s", path, in_effect)
    if config.vocab_size > target_config.vocab_size:
        raise ValueError(f"draft_model {path!r} has {config.vocab_size} logits, more than the "
                         f"model's {target_config.vocab_size}: its drafts could name tokens "
                         "the model does not have")
    return model, config


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, path: str) -> None:
    ours = target.backend.get_vocab(with_added_tokens=True)
    theirs = draft.backend.get_vocab(with_added_tokens=True)
    if ours == theirs:
        return
    differing = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    token = differing[0]
    raise ValueError(
        f"draft_model {path!r} has another vocabulary than the model ({len(theirs)} tokens "
        f"vs {len(ours)}; {len(differing)} differ, e.g. {token!r} is id {theirs.get(token)} "
        f"in the draft and {ours.get(token)} in the model): drafts must be the model's "
        "token ids")
