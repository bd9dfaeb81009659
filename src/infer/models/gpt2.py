"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU MLP, biases everywhere.

Module names follow HF's `GPT2LMHeadModel`, so loading is a rename-free copy except that
HF stores its `Conv1D` weights as `[in, out]`: they are transposed once at load time and
the runtime uses ordinary `nn.Linear` (`[out, in]`). `c_attn` is already q/k/v fused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention import Attention, AttentionMetadata
from infer.config import ConfigError, ModelConfig
from infer.models.layers import activation
from infer.models.weights import load_weights

# HF Conv1D weights, stored `[in, out]` (the transpose of nn.Linear's layout).
CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# Causal-mask buffers that old checkpoints saved next to the parameters.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn = Attention(cfg.num_heads, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, meta))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _check_config(cfg)
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; `compute_logits` picks the rows needed.

        `positions` index the learned position table, so each must be below
        `max_position_embeddings` (GPT-2 cannot extrapolate past it)."""
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Load HF-named tensors in HF's layout (Conv1D weights `[in, out]`), with or
        without the `transformer.` prefix (the original OpenAI checkpoints lack it)."""
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if name.endswith(MASK_BUFFERS):
                return None
            if name.startswith("lm_head."):
                return None if tied else name
            return name if name.startswith("transformer.") else "transformer." + name

        load_weights(self, _linear_layout(weights), {}, lambda name: [], rename, source=source)


def _linear_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Transpose Conv1D weights `[in, out]` to nn.Linear's `[out, in]` (a view; the copy
    into the parameter makes it contiguous)."""
    for name, tensor in weights:
        yield name, (tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor)


def _check_config(cfg: ModelConfig) -> None:
    if cfg.num_kv_heads != cfg.num_heads or cfg.q_size != cfg.hidden_size:
        raise ConfigError(
            "GPT-2 needs num_kv_heads == num_heads and num_heads * head_dim == hidden_size, got "
            f"{cfg.num_kv_heads}, {cfg.num_heads}, {cfg.head_dim}, {cfg.hidden_size}"
        )
