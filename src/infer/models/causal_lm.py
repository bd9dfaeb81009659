"""The causal LM that every architecture is: token embedding -> layers -> final norm -> LM head.

An architecture's model class is a `CausalLM` subclass that builds its layers and final norm
(and, where its checkpoints name things differently, overrides `checkpoint_name`). The rest
is here: Gemma's embedding scaling and GPT-2's learned positions (switches), the LM head
(tied: the embedding's parameter), the logit soft-cap, and weight loading, with the
checkpoint's separate q/k/v and gate/up projections landing in their fused parameters.

Layers are called `layer(positions, x, residual, meta) -> (x, residual)`: the residual
stream is `x + residual` (`residual` None: just `x`), so that each residual add can fuse
into the next RMSNorm; a layer that keeps the stream whole in `x` returns `(x, None)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from infer.attention import AttentionMetadata
from infer.config import ModelConfig
from infer.distributed.group import SINGLE
from infer.models.linear import ParallelLMHead, VocabParallelEmbedding
from infer.models.weights import ShardId, load_weights

# HF checkpoint projection -> (our fused parameter, shard id)
FUSED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderModel(nn.Module):
    """HF's `model.`: the embeddings, the layers (sharing `rotary`, registered here once),
    the final norm."""

    def __init__(
        self, cfg: ModelConfig, layers: Iterable[nn.Module], norm: nn.Module,
        rotary: nn.Module | None = None, scale_embeddings: bool = False,
        learned_positions: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # Replicated on every rank, never split.
        self.embed_positions = (
            VocabParallelEmbedding(cfg.max_position_embeddings, cfg.hidden_size, tp=SINGLE)
            if learned_positions else None
        )
        # Created in the default (= weight) dtype and cast along with the model, so in bf16
        # the scale is rounded exactly as transformers rounds it (sqrt(640) -> 25.25).
        scale = torch.tensor(cfg.hidden_size**0.5) if scale_embeddings else None
        self.register_buffer("embed_scale", scale, persistent=False)
        self.rotary = rotary
        # Each is told when a forward pass starts and ends (`begin` / `end`).
        self._rotaries = ([] if rotary is None else list(rotary.values())
                          if isinstance(rotary, nn.ModuleDict) else [rotary])
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """`num_layers`: run only the first that many layers (then the final norm)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        if self.embed_positions is not None:
            # Positions index a learned table: each must be below max_position_embeddings.
            x = x + self.embed_positions(positions)
        for rotary in self._rotaries:
            rotary.begin(positions)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(positions, x, residual, meta)
        for rotary in self._rotaries:
            rotary.end()
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        tied = model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tied=tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; `compute_logits` picks the rows needed.
        `num_layers`: of the first that many layers only (an early exit: self-drafts)."""
        return self.model(input_ids, positions, meta, num_layers)

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """float32 logits of `hidden`'s rows; without `as_float`, the LM head's own dtype
        where nothing else needs float32 (a draft that takes only their argmax)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            return torch.tanh(logits.float() / cap) * cap
        return logits.float() if as_float else logits

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        load_weights(self, weights, self.param_for, source)

    def param_for(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        """Our parameter, and the shard of it, that a checkpoint tensor fills (None: skip)."""
        name = self.checkpoint_name(ckpt_name)
        if name is None:
            return None
        for part, (fused, shard) in FUSED.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model, or None for a tensor that is not ours
        (rotary tables; the LM head of a tied model)."""
        if "rotary_emb." in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        return name
