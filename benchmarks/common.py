"""Shared pieces of the GPU benchmarks (decode.py, throughput.py, prefill.py, startup.py).

- the two ceilings, measured in the same run as the benchmark: device-to-device copy
  bandwidth (GB/s, bytes read + bytes written) and the bf16 matrix-product rate at
  8192^3 (TFLOP/s); on a CPU both are measured small, in float32, only so that --tiny
  runs exercise every code path;
- random-weight HF checkpoints in the real shapes of benchmarks/configs/*.json, written
  with transformers' config classes (bf16 `save_pretrained`) plus a word-level tokenizer
  ("t0".."t{V-1}"), cached under a checkpoint root so that the scripts of one run share them;
- byte and FLOP counts of a shape (weights read per step, KV bytes per token, ...);
- engine flags passed through from the command line (`--engine name=value`) into LLM kwargs;
- results: JSON under benchmarks/results/<name>_<device><suffix>.json with environment info,
  and a plain-text table printed last.

The scripts import this as `common` (they put their own folder on sys.path).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
CONFIGS = BENCH_DIR / "configs"
RESULTS = BENCH_DIR / "results"
ROOT = BENCH_DIR.parent
# The repository's src/ when infer is not importable otherwise (a PYTHONPATH or an install
# that provides it wins, so a checkout of another engine version can be benchmarked).
try:
    import importlib.util

    _HAVE_INFER = importlib.util.find_spec("infer") is not None
except (ImportError, ValueError):
    _HAVE_INFER = False
if not _HAVE_INFER and (ROOT / "src" / "infer").is_dir():
    sys.path.append(str(ROOT / "src"))

# --tiny: the real architecture (model_type, tying, rope) at a size a CPU runs in seconds.
TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=512)
CKPT_MARKER = "bench_shape.json"


# -- command line -------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """'8' -> 8, '0.5' -> 0.5, 'true'/'false' -> bool, 'none'/'null' -> None, else the str."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_engine_flags(items: Sequence[str] | None) -> dict[str, Any]:
    """['attention_backend=triton', 'cuda_graphs=true'] -> LLM kwargs. Each item may also
    hold several space- or comma-separated pairs. Names are checked against EngineConfig."""
    flags: dict[str, Any] = {}
    for item in items or ():
        for pair in item.replace(",", " ").split():
            if "=" not in pair:
                raise SystemExit(f"--engine expects name=value, got {pair!r}")
            name, value = pair.split("=", 1)
            flags[name.strip().replace("-", "_")] = parse_value(value)
    try:
        from infer.engine.config import EngineConfig
    except ImportError:
        return flags
    known = set(EngineConfig.field_names())
    unknown = sorted(set(flags) - known)
    if unknown:
        raise SystemExit(f"unknown engine flag(s) {', '.join(unknown)}; EngineConfig has: "
                         f"{', '.join(sorted(known))}")
    if "model" in flags:
        raise SystemExit("--engine model=... is not allowed: the benchmark picks the checkpoint")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for name, value in flags.items():  # `quantization=none` is the word, not a missing value
        if value is None and isinstance(defaults[name], str):
            flags[name] = "none"
    return flags


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                        help="engine flag passed to LLM(...) (repeatable), e.g. "
                             "--engine attention_backend=triton --engine cuda_graphs=true")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes and token counts (CPU check of the script)")
    parser.add_argument("--suffix", default="", help="appended to the results file name")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--ckpt-root", default=os.environ.get("INFER_BENCH_CKPTS"),
                        help="where random checkpoints are cached (default: /dev/shm/"
                             "infer_bench when it has room, else the temp dir)")
    parser.add_argument("--skip-peer", action="store_true", help="skip HF transformers")


def cli_flags(flags: dict[str, Any]) -> list[str]:
    """Engine flags as `infer serve` takes them (booleans as --name / --no-name)."""
    out = []
    for name, value in flags.items():
        name = name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{name}" if value else f"--no-{name}")
        else:
            out.append(f"--{name}={value}")
    return out


def merged_flags(defaults: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """The script's sizing defaults (max_model_len, max_num_seqs, ...) under the user's."""
    return {**defaults, **user}


# -- environment and device ---------------------------------------------------------------
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "_")


def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "infer_commit": os.environ.get("INFER_BENCH_COMMIT") or _git_commit(),
    }
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # not installed, or broken on this machine
            info[mod] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
    else:
        info["torch_threads"] = torch.get_num_threads()
    return info


def _git_commit() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty src" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def setup_cpu_threads() -> None:
    """One torch thread on a CPU: on the project's 2-core machines, two threads spinning
    against other processes make small matmuls 10-50x slower (docs/performance.md)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


# -- ceilings -----------------------------------------------------------------------------
def time_fn(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds of fn (device events on CUDA, a synchronised host clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    return host_time(fn, reps, warmup=0)


def host_time(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds of fn on the host clock (no device synchronisation)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, GB/s counting bytes read + bytes written (1 GiB on a GPU)."""
    dev = device()
    numel = (1 << 29) if dev.type == "cuda" else (1 << 24)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    src = torch.randn(numel, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    sec = time_fn(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * src.element_size() / sec / 1e9


def matmul_tflops() -> float:
    """bf16 [8192x8192] @ [8192x8192] on a GPU (float32 1024^3 on a CPU), TFLOP/s, random
    data (zeros run faster), two input sets rotated."""
    dev = device()
    n, dt = (8192, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    sets = [(torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt))
            for _ in range(2)]
    out = torch.empty(n, n, device=dev, dtype=dt)
    i = [0]

    def step() -> None:
        a, b = sets[i[0] % 2]
        i[0] += 1
        torch.matmul(a, b, out=out)

    sec = time_fn(step, reps=10 if dev.type == "cuda" else 3)
    return 2 * n**3 / sec / 1e12


def ceilings() -> dict[str, float]:
    """Both ceilings, measured now; their buffers are freed before the engine starts."""
    c = {"copy_GBps": copy_bandwidth_gbs()}
    free_memory()
    c["matmul_TFLOPs"] = matmul_tflops()
    free_memory()
    print(f"[ceilings] {device_name()}: copy {c['copy_GBps']:.0f} GB/s (read+write), "
          f"matmul {c['matmul_TFLOPs']:.1f} TFLOP/s "
          f"({'bf16 8192^3' if torch.cuda.is_available() else 'fp32 1024^3, CPU'})",
          flush=True)
    return c


# -- shapes and checkpoints ---------------------------------------------------------------
def load_shape(name: str, tiny: bool = False) -> dict[str, Any]:
    path = CONFIGS / f"{name}.json"
    shape = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    if tiny:
        shape.update(TINY_OVERRIDES)
        for key in ("bos_token_id", "eos_token_id"):
            shape[key] = {"bos_token_id": 1, "eos_token_id": 2}[key]
    return shape


def hf_config(shape: dict[str, Any]):
    from transformers import AutoConfig

    kwargs = dict(shape)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


@dataclasses.dataclass(frozen=True)
class ShapeCounts:
    """Parameter counts of one shape (from the HF model built on the meta device)."""
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    total_params: int  # unique parameters (tied embeddings once)
    body_params: int  # all but the embedding table and the LM head
    lm_head_params: int  # vocab * hidden (the tied embedding when tied)

    @property
    def step_weight_params(self) -> int:
        """Read once per forward step: the body + the LM head; the embedding table is not
        read (only a few rows are gathered), and when tied it is read once, as the head."""
        return self.body_params + self.lm_head_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def attn_flops(self, query_tokens: float, context: float) -> float:
        """QK^T and PV: 2 matmuls x 2 FLOP x heads x head_dim per (query, key) pair."""
        return 4.0 * self.layers * self.heads * self.head_dim * query_tokens * context


def shape_counts(shape: dict[str, Any]) -> ShapeCounts:
    from transformers import AutoModelForCausalLM

    config = hf_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # shared (tied) parameters appear once
    total = sum(p.numel() for p in params.values())
    embed = sum(p.numel() for n, p in params.items() if "embed_tokens" in n)
    head = sum(p.numel() for n, p in params.items() if n.startswith("lm_head"))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    hidden, vocab = config.hidden_size, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return ShapeCounts(
        layers=config.num_hidden_layers, heads=heads,
        kv_heads=config.num_key_value_heads or heads, head_dim=head_dim, hidden=hidden,
        vocab=vocab, tied=tied, total_params=total, body_params=total - embed - head,
        lm_head_params=vocab * hidden,
    )


def checkpoint_root(arg: str | None, need_bytes: int) -> Path:
    if arg:
        return Path(arg)
    shm = Path("/dev/shm")
    if shm.is_dir():
        try:
            if shutil.disk_usage(shm).free > 2 * need_bytes + (4 << 30):
                return shm / "infer_bench"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / "infer_bench"


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))


def get_checkpoint(name: str, tiny: bool, root_arg: str | None,
                   tokenizer_dir: Path | None = None) -> Path:
    """Directory of a random-weight bf16 HF checkpoint in the shape `name`; written once per
    root (the marker file holds the shape) and reused by later scripts of the same run.

    With `tokenizer_dir` (tokenizer.json + tokenizer_config.json of a real model), the
    checkpoint takes that tokenizer and its vocabulary size, so text prompts tokenize as
    they would for a real model."""
    from transformers import AutoModelForCausalLM

    shape = load_shape(name, tiny)
    suffix = "-tiny" if tiny else ""
    if tokenizer_dir is not None:
        vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
        shape.update(vocab_size=len(vocab), bos_token_id=None, eos_token_id=None)
        suffix += f"-{tokenizer_dir.name}"
    counts = shape_counts(shape)
    root = checkpoint_root(root_arg, 2 * counts.total_params)
    path = root / (name + suffix)
    marker = path / CKPT_MARKER
    if marker.exists() and json.loads(marker.read_text()) == shape:
        print(f"[ckpt] reusing {path}", flush=True)
        return path
    t = time.perf_counter()
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = hf_config(shape)
    torch.manual_seed(0)
    # Built (and randomly initialised) directly on the GPU in bf16: an 8B model built on
    # the host in float32 would take minutes.
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    free_memory()
    if tokenizer_dir is None:
        write_tokenizer(tmp, config.vocab_size)
    else:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / file, tmp / file)
    (tmp / CKPT_MARKER).write_text(json.dumps(shape))
    tmp.rename(path)
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e9
    print(f"[ckpt] wrote {name}{' (tiny)' if tiny else ''}: {counts.total_params / 1e9:.3f}B "
          f"params, {size:.2f} GB in {time.perf_counter() - t:.1f} s -> {path}", flush=True)
    return path


# -- engines ------------------------------------------------------------------------------
def build_llm(path: Path, flags: dict[str, Any]):
    from infer import LLM

    free_memory()
    t = time.perf_counter()
    llm = LLM(str(path), **flags)
    sync()
    build_s = time.perf_counter() - t
    eng = llm.engine
    print(f"[infer] built in {build_s:.1f} s on {eng.device} {eng.dtype}, flags {flags}",
          flush=True)
    return llm, build_s


def engine_info(llm) -> dict[str, Any]:
    eng = llm.engine
    info: dict[str, Any] = {"device": str(eng.device), "dtype": str(eng.dtype)}
    try:
        info["config"] = dataclasses.asdict(eng.config)
    except TypeError:
        info["config"] = repr(eng.config)
    try:
        info["stats"] = eng.stats()
    except Exception as exc:  # stats are informational only
        info["stats"] = f"unavailable: {exc}"
    return info


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    free_memory()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 device_map=str(device()))
    model.eval()
    sync()
    print(f"[hf] loaded in {time.perf_counter() - t:.1f} s ({dtype}, "
          f"attn {model.config._attn_implementation})", flush=True)
    return model


def random_prompts(rng, count: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct random prompts (fresh ones per timed call keep the prefix cache out)."""
    top = min(vocab, 32000) - 1
    return [[rng.randint(3, top) for _ in range(length)] for _ in range(count)]


# -- results ------------------------------------------------------------------------------
def results_path(name: str, args: argparse.Namespace) -> Path:
    suffix = ("_tiny" if args.tiny else "") + args.suffix
    return Path(args.results_dir) / f"{name}_{device_slug()}{suffix}.json"


def write_results(name: str, args: argparse.Namespace, payload: dict[str, Any]) -> Path:
    """Written after every row, so a run cut short still leaves what it measured."""
    out = results_path(name, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "env": env_info(), "args": vars(args), **payload}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(out)
    return out


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def print_table(title: str, rows: list[dict[str, Any]],
                columns: list[tuple[str, str, str]]) -> None:
    """columns: (header, key, format spec)."""
    cells = [[fmt(r.get(key), spec) for _, key, spec in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    sys.stdout.flush()
