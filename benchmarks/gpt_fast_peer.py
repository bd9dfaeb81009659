"""gpt-fast (pytorch-labs/gpt-fast) as a decode peer, run as `generate.py --compile` runs it.

Its own code from a gpt-fast tree given on the command line (`--gpt-fast DIR`; the project
holds none of it): generate.py imported as a module (a stub stands in for its tokenizer
module, which needs sentencepiece and tiktoken and is not used), its `Transformer` from
model.py, and its `generate` (non-speculative, non-interactive) driving it. As its `main`
does with `--compile`: `decode_one_token` wrapped in `torch.compile(mode="reduce-overhead",
fullgraph=True)`, prefill eager, with the inductor flags its import sets (held for
gpt-fast's runs only). bf16, our engine's dtype; its sampler (softmax + exponential race)
at its default top_k=200 and a temperature of 1e-5 (its own floor): greedy in effect.

Weights: the same checkpoint as ours, converted as its scripts/convert_hf_checkpoint.py does
(its names, the rotary permutation of wq/wk, wq/wk/wv concatenated into wqkv), in memory.
A tied embedding is shared with its separate `output` weight, so a step reads the LM head
once, as ours does.

Differences from the HF shape that are handled: gpt-fast derives head_dim = dim // n_head
(and its wo is dim x dim), so a shape whose head_dim differs is refused; its default
intermediate size is a rounded 8/3 x dim, so ours is passed; its llama3 rope scaling reads
factor / low_freq_factor / high_freq_factor / original_max_position_embeddings from a dict
(no rope_type key), and block_size (the positions its rope table covers) is
max_position_embeddings.

Before timing, its logits over one random prompt are compared with transformers' on the
same checkpoint (`agreement_with_hf`; in each row): the conversion is checked, not assumed.

Timing as decode.py's infer rows, per batch size (each on a fresh dynamo state and fresh
caches, as a new `generate.py --batch_size B` process would be): one warm-up generate of
1+N tokens (compile included: compile_s, as generate.py reports its "Compilation time"),
then per repeat T(2) and T(1+N) on a fresh random prompt; step = (T(1+N) - T(2)) / (N - 1),
median over the repeats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import common
import torch

TEMPERATURE = 1e-5
TOP_K = 200


def model_args(gf: ModuleType, shape: dict[str, Any]):
    """gpt-fast's ModelArgs for an HF llama config dict."""
    if shape.get("model_type") != "llama" or shape.get("attention_bias") or \
            shape.get("mlp_bias") or shape.get("hidden_act", "silu") != "silu":
        raise ValueError("gpt-fast's model.py is the llama architecture only (no biases)")
    dim, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise ValueError(f"gpt-fast derives head_dim = dim // n_head = {dim // heads}; "
                         f"this shape has head_dim {head_dim}")
    kwargs: dict[str, Any] = dict(
        block_size=shape["max_position_embeddings"], vocab_size=shape["vocab_size"],
        n_layer=shape["num_hidden_layers"], n_head=heads, dim=dim,
        intermediate_size=shape["intermediate_size"],
        n_local_heads=shape.get("num_key_value_heads") or heads, head_dim=head_dim,
        rope_base=shape.get("rope_theta", 10000.0), norm_eps=shape["rms_norm_eps"])
    scaling = shape.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"gpt-fast has llama3 rope scaling only, not {kind}")
        if "rope_scaling" not in {f.name for f in dataclasses.fields(gf.ModelArgs)}:
            raise ValueError("this gpt-fast model.py predates llama3 rope scaling")
        kwargs["rope_scaling"] = {k: scaling[k] for k in (
            "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")}
    args = gf.ModelArgs(**kwargs)
    assert args.head_dim == head_dim and args.intermediate_size == kwargs["intermediate_size"]
    return args


@torch.no_grad()  # inference tensors could not become parameters
def converted_state_dict(checkpoint_path: Path, args, device: torch.device,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """convert_hf_checkpoint.py's mapping, in memory, one layer at a time."""
    from safetensors.torch import load_file

    hf: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint_path).glob("*.safetensors")):
        hf.update(load_file(str(file), device=str(device)))

    def take(name: str) -> torch.Tensor:
        return hf.pop(name).to(dtype)

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
        return (w.view(n_head, 2, args.head_dim // 2, args.dim).transpose(1, 2)
                .reshape(args.head_dim * n_head, args.dim))

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
           "norm.weight": take("model.norm.weight")}
    out["output.weight"] = take("lm_head.weight") if "lm_head.weight" in hf \
        else out["tok_embeddings.weight"]
    for i in range(args.n_layer):
        hf_p, p = f"model.layers.{i}.", f"layers.{i}."
        q = permute(take(hf_p + "self_attn.q_proj.weight"), args.n_head)
        k = permute(take(hf_p + "self_attn.k_proj.weight"), args.n_local_heads)
        v = take(hf_p + "self_attn.v_proj.weight")
        out[p + "attention.wqkv.weight"] = torch.cat([q, k, v])
        del q, k, v
        out[p + "attention.wo.weight"] = take(hf_p + "self_attn.o_proj.weight")
        out[p + "feed_forward.w1.weight"] = take(hf_p + "mlp.gate_proj.weight")
        out[p + "feed_forward.w3.weight"] = take(hf_p + "mlp.up_proj.weight")
        out[p + "feed_forward.w2.weight"] = take(hf_p + "mlp.down_proj.weight")
        out[p + "attention_norm.weight"] = take(hf_p + "input_layernorm.weight")
        out[p + "ffn_norm.weight"] = take(hf_p + "post_attention_layernorm.weight")
        hf.pop(hf_p + "self_attn.rotary_emb.inv_freq", None)
    if hf:
        raise ValueError(f"unconverted checkpoint tensors: {sorted(hf)[:5]}")
    return out


def build_model(gen: ModuleType, shape: dict[str, Any], checkpoint_path: Path,
                device: torch.device, dtype: torch.dtype):
    """As generate.py's _load_model: built on meta, then `load_state_dict(assign=True)`."""
    args = model_args(sys.modules[gen.Transformer.__module__], shape)
    with torch.device("meta"):
        model = gen.Transformer(args)
    model.load_state_dict(converted_state_dict(checkpoint_path, args, device, dtype),
                          assign=True)
    return model.to(device=device, dtype=dtype).eval()


# -- its generate.py -----------------------------------------------------------------------
_GENERATE_PY_FLAGS = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True,
                      "fx_graph_cache": True}


def import_generate_py(gpt_fast_dir: Path) -> ModuleType:
    """Its generate.py as a module, run through its own `generate`. Its `tokenizer` module
    (sentencepiece, tiktoken) is never used here: a stub stands in for it. The flags the
    import sets globally are put back (`generate_py_flags` sets them for gpt-fast's runs)."""
    directory = str(Path(gpt_fast_dir).resolve())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    stub = ModuleType("tokenizer")
    stub.get_tokenizer = None  # type: ignore[attr-defined]
    saved = torch._inductor.config.save_config()
    sys.modules.setdefault("tokenizer", stub)
    try:
        spec = importlib.util.spec_from_file_location("gpt_fast_generate",
                                                      Path(directory) / "generate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if sys.modules.get("tokenizer") is stub:
            del sys.modules["tokenizer"]
        torch._inductor.config.load_config(saved)
    return module


def generate_py_flags() -> contextlib.ExitStack:
    """The inductor / functorch flags generate.py sets at import, for gpt-fast's runs only
    (the other engines of the run keep theirs)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(_GENERATE_PY_FLAGS))
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=True))
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message=".*sdp_kernel.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")
    return stack


def release_caches(model) -> None:
    for block in model.layers:
        block.attention.kv_cache = None
    model.max_batch_size = model.max_seq_length = -1


# -- the same model? ---------------------------------------------------------------------
@torch.no_grad()
def agreement_with_hf(model, checkpoint_path: Path, dtype: torch.dtype, length: int,
                      vocab: int, rng) -> dict[str, float]:
    """The converted model's logits over one random prompt against transformers' on the
    same checkpoint, same dtype and device: the peer must run the model we run (a wrong
    rotary permutation or a swapped w1/w3 would time the same and compute nonsense)."""
    dev = common.device()
    ids = torch.tensor(common.random_prompts(rng, 1, length, vocab), device=dev)
    with torch.device(dev):
        model.setup_caches(1, length)
    ours = model(ids.int(), torch.arange(length, device=dev)).float()
    release_caches(model)
    hf = common.load_hf(checkpoint_path, dtype)
    ref = hf(ids).logits.float()
    del hf
    common.free_memory()
    return dict(check_logits_max_abs=(ours - ref).abs().max().item(),
                check_logits_ref_max=ref.abs().max().item(),
                check_argmax_agree=(ours.argmax(-1) == ref.argmax(-1)).float().mean().item())


# -- the benchmark ------------------------------------------------------------------------
def time_batch(gen: ModuleType, model, batch: int, prompt_len: int, new_tokens: int,
               vocab: int, rng, repeats: int) -> dict[str, Any]:
    """Its `generate` makes one prompt's `batch` copies (as its --batch_size does) and fails
    for a single new token, so the step time is (T(1+N) - T(2)) / (N - 1)."""
    dev = common.device()

    def timed(n: int) -> float:
        prompt = torch.tensor(common.random_prompts(rng, 1, prompt_len, vocab)[0],
                              dtype=torch.int, device=dev)
        common.sync()
        t = time.perf_counter()
        seq, _ = gen.generate(model, prompt, n, batch, interactive=False, draft_model=None,
                              temperature=TEMPERATURE, top_k=TOP_K)
        common.sync()
        dt = time.perf_counter() - t
        assert seq.shape == (batch, prompt_len + n), seq.shape
        return dt

    compile_s = timed(1 + new_tokens)
    pairs = []
    for _ in range(repeats):
        t2, tn = timed(2), timed(1 + new_tokens)
        pairs.append((t2, tn, max(tn - t2, 1e-9) / (new_tokens - 1) * 1e3))
    t2, tn, step_ms = sorted(pairs, key=lambda p: p[2])[len(pairs) // 2]
    return dict(engine="gpt-fast", batch=batch, prefill_s=t2, total_s=tn, step_ms=step_ms,
                tok_per_s=batch / step_ms * 1e3, step_ms_all=[p[2] for p in pairs],
                compile_s=compile_s)


def run_gpt_fast(gpt_fast_dir: Path, shape: dict[str, Any], checkpoint_path: Path,
                 dtype: torch.dtype, batches: list[int], prompt_len: int, new_tokens: int,
                 vocab: int, rng, repeats: int, emit: Callable[[dict], None]) -> list[dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    gen = import_generate_py(gpt_fast_dir)
    decode_one_token = gen.decode_one_token
    common.free_memory()
    t = time.perf_counter()
    model = build_model(gen, shape, checkpoint_path, common.device(), dtype)
    common.sync()
    load_s = time.perf_counter() - t
    print(f"[gpt-fast] loaded {Path(gpt_fast_dir) / 'model.py'} in {load_s:.1f} s ({dtype})",
          flush=True)
    agree = agreement_with_hf(model, checkpoint_path, dtype, min(prompt_len, 64), vocab, rng)
    print(f"[gpt-fast] logits vs transformers over {min(prompt_len, 64)} positions: max |diff| "
          f"{agree['check_logits_max_abs']:.3g} (|logits| up to "
          f"{agree['check_logits_ref_max']:.3g}), argmax agrees at "
          f"{agree['check_argmax_agree']:.0%}", flush=True)
    rows = []
    try:
        with generate_py_flags():
            for batch in batches:
                torch._dynamo.reset()
                release_caches(model)
                common.free_memory()
                # As its main() does with --compile.
                gen.decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead",
                                                     fullgraph=True)
                skips = counters["inductor"]["cudagraph_skips"]
                row = time_batch(gen, model, batch, prompt_len, new_tokens, vocab, rng,
                                 repeats)
                # nonzero on CUDA: the compiled step fell back to running without CUDA graphs
                skips = counters["inductor"]["cudagraph_skips"] - skips
                row.update(compiled=True, cudagraph_skips=skips, load_s=load_s, **agree)
                emit(row)
                rows.append(row)
    finally:
        gen.decode_one_token = decode_one_token
        release_caches(model)
        del model
        torch._dynamo.reset()
        common.free_memory()
    return rows
