"""llama.cpp CUDA as a peer on the very random GGUF files that `decode.py --gguf` serves
(llama-3.1-8b shape, Q4_K_M and Q8_0, seed 0: gguf_checkpoint.get_gguf).

    python3 benchmarks/llamacpp_cuda.py [--mixes Q4_K_M Q8_0] [--results-dir DIR]
    python3 benchmarks/llamacpp_cuda.py --tiny     # CPU build and tiny file: a check, minutes
    python3 benchmarks/llamacpp_cuda.py --make-archive llama_cpp_python-0.3.36.tar.gz

The sdist comes from the package index (`pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`); `--make-archive` strips it into the archive below (~2 MB).

llama.cpp comes as sources: `.llamacpp/llama.cpp.tar.xz` (ignored by git, carried to the
device by name) is vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist, stripped to what
`llama-bench` and `llama-batched-bench` need (ggml core, ggml-cpu, ggml-cuda, ggml-blas,
src, common, vendor, the two tools; tools/CMakeLists.txt rewritten to add only those). The
script unpacks and builds it (`-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90`, Release,
ninja, the two targets only) under /tmp, and reuses a build whose binaries exist. The build
runs while the GGUF files are written.

Measurements, each llama.cpp's own tool as its users run it (all layers on the GPU):
- `llama-bench -m FILE -ngl 99 -p 2048 -n 128 -r 5 -o json`: tg128 (batch 1, from an empty
  context; mean of 5 runs after a warm-up) and pp2048 (one 2048-token prompt, ubatch 512);
- `llama-batched-bench -m FILE -ngl 99 -c C -npp 128 -ntg 256 -npl 1,32,1,32,1,32
  --output-format jsonl`: our decode benchmark's protocol, per sequence a 128-token random
  prompt, then 256 decode steps of all sequences together, timed apart from the prompt
  (median of the 3 runs per batch size).
Per decode step, the same metric as decode.py: bytes = the file's tensor bytes but the
token embedding table (a step gathers a few rows; the output matrix is read whole) + the
f16 KV bytes at the mean context, as a fraction of the copy bandwidth measured in the same
run (common.ceilings). pp2048 counts as one step of 2048 tokens (FLOP/s is its metric).
Shapes (layers, heads, ...) are read from the file. Prints one table and writes
benchmarks/results/llamacpp_cuda_<device><suffix>.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import gguf_checkpoint
from decode import step_metrics

ARCHIVE = common.ROOT / ".llamacpp" / "llama.cpp.tar.xz"
SOURCE = "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp (stripped)"
TOOLS = ("llama-bench", "llama-batched-bench")
KV_BYTES = 2  # llama.cpp's default KV cache type is f16


# What of the sdist's vendor/llama.cpp the archive keeps (the device carries 64 MiB at most).
KEEP_TOP = {"AUTHORS", "CMakeLists.txt", "CMakePresets.json", "LICENSE", "cmake", "common",
            "ggml", "grammars", "include", "licenses", "src", "tools", "vendor"}
KEEP_BACKENDS = {"ggml-blas", "ggml-cpu", "ggml-cuda"}
KEEP_TOOLS = {"batched-bench", "llama-bench"}
TOOLS_CMAKE = """# Stripped for infer's benchmarks/llamacpp_cuda.py: the two benchmark tools only.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
"""


def make_archive(sdist: Path, archive: Path) -> None:
    """The sdist's llama.cpp, other backends, tools, docs, tests and models left out."""
    def keep(parts: tuple[str, ...]) -> bool:
        if parts[0] not in KEEP_TOP:
            return False
        if parts[:2] == ("ggml", "src") and len(parts) > 2 and parts[2].startswith("ggml-") \
                and "." not in parts[2]:
            return parts[2] in KEEP_BACKENDS
        if parts[0] == "tools" and len(parts) > 1:
            return parts[1] in KEEP_TOOLS or parts[1] == "CMakeLists.txt"
        return parts[:3] != ("vendor", "miniaudio", "miniaudio.h")  # only its include dir

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as src, tarfile.open(archive, "w:xz") as out:
        for member in src.getmembers():
            path = member.name.split("/")
            if "vendor" not in path or path[path.index("vendor") + 1:][:1] != ["llama.cpp"]:
                continue
            rel = tuple(path[path.index("vendor") + 2:])
            if not rel or not keep(rel):
                continue
            name = "/".join(("llama.cpp", *rel))
            if member.isdir():
                member.name = name
                out.addfile(member)
                continue
            # files, and links (the sdist links some CUDA template instances) as files
            data = (TOOLS_CMAKE.encode() if rel == ("tools", "CMakeLists.txt")
                    else src.extractfile(member).read())
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), member.mode, member.mtime
            out.addfile(info, io.BytesIO(data))
    print(f"wrote {archive}: {archive.stat().st_size / 1e6:.1f} MB")


# -- build --------------------------------------------------------------------------------
def cmake_flags(cuda: bool, arch: str) -> list[str]:
    flags = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF"]
    if not cuda:
        return [*flags, "-DGGML_CUDA=OFF"]
    flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_CUDA_NCCL=OFF"]
    nvcc = shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
    return [*flags, f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else flags


def start_build(archive: Path, build: Path, cuda: bool, arch: str,
                jobs: int) -> tuple[subprocess.Popen | None, list[str], float]:
    """Starts configure + build in the background (None when the binaries exist)."""
    if all((build / "bin" / t).exists() for t in TOOLS):
        print(f"[llama.cpp] reusing the build in {build}", flush=True)
        return None, [], time.perf_counter()
    src = build.with_name(build.name + "-src")
    if not (src / "llama.cpp" / "CMakeLists.txt").exists():
        if not archive.exists():
            raise SystemExit(f"{archive} is missing (see this script's docstring)")
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    flags = cmake_flags(cuda, arch)
    configure = ["cmake", "-S", str(src / "llama.cpp"), "-B", str(build), *flags]
    compile_ = ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS]
    build.mkdir(parents=True, exist_ok=True)
    script = " && ".join(shlex.join(cmd) for cmd in (configure, compile_))
    print(f"[llama.cpp] building in the background: {script}", flush=True)
    log = open(build / "build.log", "w")  # noqa: SIM115 (closed with the process)
    # a session of its own, so that a timeout ends ninja and the compilers with it
    proc = subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, flags, time.perf_counter()


def stop_build(proc: subprocess.Popen | None) -> None:
    """SIGTERM first: ninja puts each compiler in a process group of its own and ends
    them only when it is asked to stop, not when it is killed."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finish_build(proc: subprocess.Popen | None, build: Path, started: float,
                 timeout: float) -> float | None:
    """Seconds the build took (None when reused); exits with the log's tail on failure."""
    if proc is None:
        return None
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        stop_build(proc)
        rc = "timeout"
    seconds = time.perf_counter() - started
    if rc != 0 or not all((build / "bin" / t).exists() for t in TOOLS):
        tail = (build / "build.log").read_text(errors="replace").splitlines()[-80:]
        print("\n".join(tail))
        raise SystemExit(f"[llama.cpp] build failed ({rc}) after {seconds:.0f} s")
    print(f"[llama.cpp] built in {seconds:.0f} s", flush=True)
    return seconds


# -- the file -----------------------------------------------------------------------------
def file_counts(path: Path) -> tuple[common.ShapeCounts, int, int]:
    """(shape counts, bytes a decode step reads, all tensor bytes), from the GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def meta(key: str) -> int:
        field = reader.fields[f"llama.{key}"]
        return int(field.parts[field.data[0]][0])

    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    skip = set() if tied else {"token_embd.weight"}
    step_bytes = sum(int(t.n_bytes) for n, t in tensors.items() if n not in skip)
    step_params = sum(int(t.n_elements) for n, t in tensors.items() if n not in skip)
    embd = tensors["token_embd.weight"]
    hidden, vocab = (int(x) for x in embd.shape[:2])
    heads = meta("attention.head_count")
    counts = common.ShapeCounts(
        layers=meta("block_count"), heads=heads, kv_heads=meta("attention.head_count_kv"),
        head_dim=meta("attention.key_length"), hidden=hidden, vocab=vocab, tied=tied,
        total_params=sum(int(t.n_elements) for t in tensors.values()),
        body_params=step_params - vocab * hidden, lm_head_params=vocab * hidden)
    return counts, step_bytes, sum(int(t.n_bytes) for t in tensors.values())


# -- the tools ----------------------------------------------------------------------------
def run_tool(cmd: list[str], timeout: float) -> str:
    print(f"[llama.cpp] {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
        raise RuntimeError(f"{Path(cmd[0]).name} exited {out.returncode}")
    print(f"[llama.cpp] done in {time.perf_counter() - t:.0f} s", flush=True)
    return out.stdout + "\n" + out.stderr


def llama_bench(binary: Path, path: Path, args) -> list[dict]:
    text = run_tool([str(binary), "-m", str(path), "-ngl", "99", "-p", str(args.pp),
                     "-n", str(args.tg), "-r", str(args.repetitions), "-o", "json"],
                    args.tool_timeout)
    doc = json.loads(text[text.index("["):text.rindex("]") + 1])
    rows = []
    for test in doc:
        prompt, gen = int(test["n_prompt"]), int(test["n_gen"])
        tokens = gen or prompt
        row = dict(tool="llama-bench", test=f"tg{gen}" if gen else f"pp{prompt}",
                   batch=1 if gen else prompt, tok_per_s=test["avg_ts"],
                   stddev_tok_per_s=test["stddev_ts"], samples_tok_per_s=test["samples_ts"],
                   mean_ctx=(gen + 1) / 2 if gen else (prompt + 1) / 2,
                   backends=test.get("backends"), gpu_info=test.get("gpu_info"),
                   flash_attn=test.get("flash_attn"), n_ubatch=test.get("n_ubatch"),
                   build_number=test.get("build_number"))
        row["step_ms"] = 1e3 / row["tok_per_s"] * (1 if gen else tokens)
        rows.append(row)
    return rows


def batched_bench(binary: Path, path: Path, args) -> list[dict]:
    ctx = max(args.batches) * (args.prompt_len + args.new_tokens + 16)
    npl = ",".join(str(b) for b in args.batches * args.batched_repeats)
    text = run_tool([str(binary), "-m", str(path), "-ngl", "99", "-c", str(ctx),
                     "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len),
                     "-ntg", str(args.new_tokens), "-npl", npl, "--output-format", "jsonl"],
                    args.tool_timeout)
    runs = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
    rows = []
    for batch in args.batches:
        mine = [r for r in runs if r["pl"] == batch]
        if not mine:
            raise RuntimeError(f"llama-batched-bench printed no result for batch {batch}")
        t_tg = statistics.median(r["t_tg"] for r in mine)
        rows.append(dict(tool="llama-batched-bench", test=f"decode {args.new_tokens}",
                         batch=batch, step_ms=1e3 * t_tg / args.new_tokens,
                         mean_ctx=args.prompt_len + (args.new_tokens + 1) / 2,
                         runs=mine, flash_attn=mine[0].get("flash_attn")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="a Llama shape of benchmarks/configs")
    p.add_argument("--mixes", nargs="+", choices=gguf_checkpoint.MIXES,
                   default=["Q4_K_M", "Q8_0"])
    p.add_argument("--archive", default=str(ARCHIVE))
    p.add_argument("--make-archive", metavar="SDIST", default=None,
                   help="write --archive from the llama-cpp-python sdist, then exit")
    p.add_argument("--build-dir", default=None,
                   help="default /tmp/llamacpp-build-cuda (a CPU build: -cpu)")
    p.add_argument("--cuda-arch", default="90")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--build-timeout", type=float, default=480.0)
    p.add_argument("--tool-timeout", type=float, default=240.0)
    p.add_argument("--tg", type=int, default=None, help="llama-bench -n (default 128, tiny 16)")
    p.add_argument("--pp", type=int, default=None, help="llama-bench -p (default 2048, tiny 64)")
    p.add_argument("--repetitions", type=int, default=5, help="llama-bench -r")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 16)")
    p.add_argument("--batched-repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes and token counts")
    p.add_argument("--suffix", default="", help="appended to the results file name")
    p.add_argument("--results-dir", default=str(common.RESULTS))
    p.add_argument("--ckpt-root", default=os.environ.get("INFER_BENCH_CKPTS"))
    args = p.parse_args()
    if args.make_archive:
        make_archive(Path(args.make_archive), Path(args.archive))
        return
    tiny = args.tiny
    args.tg = args.tg or (16 if tiny else 128)
    args.pp = args.pp or (64 if tiny else 2048)
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new_tokens = args.new_tokens or (16 if tiny else 256)
    cuda = common.device().type == "cuda"
    build = Path(args.build_dir or f"/tmp/llamacpp-build-{'cuda' if cuda else 'cpu'}")
    proc, flags, started = start_build(Path(args.archive), build, cuda, args.cuda_arch,
                                       args.jobs)
    try:
        files = {mix: gguf_checkpoint.get_gguf(args.model, mix, tiny, args.ckpt_root)
                 for mix in args.mixes}
    except BaseException:
        stop_build(proc)
        raise
    build_s = finish_build(proc, build, started, args.build_timeout)
    common.setup_cpu_threads()
    ceil = common.ceilings()
    rows: list[dict] = []
    payload = dict(source=SOURCE, cmake_flags=flags, build_s=build_s, ceilings=ceil,
                   model=args.model, rows=rows)
    out = common.write_results("llamacpp_cuda", args, payload)
    for mix, path in files.items():
        counts, step_bytes, all_bytes = file_counts(path)
        for tool, fn in (("llama-bench", llama_bench), ("llama-batched-bench", batched_bench)):
            try:
                found = fn(build / "bin" / tool, path, args)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                print(f"[llama.cpp] {tool} FAILED on {mix}: {exc!r}", flush=True)
                rows.append(dict(mix=mix, tool=tool, error=repr(exc)))
                continue
            for row in found:
                row.update(mix=mix, file=str(path), file_tensor_GB=all_bytes / 1e9)
                step_metrics(row, counts, KV_BYTES, row["batch"], row["mean_ctx"], ceil,
                             step_bytes)
                if row["test"].startswith("pp"):  # a prompt step: FLOP/s is its metric
                    row.update(kv_MB=None, GBps=None, frac_copy=None)
                rows.append(row)
                print(f"[llama.cpp] {mix} {row['test']} batch {row['batch']}: "
                      f"{row['step_ms']:.2f} ms/step {row['tok_per_s']:.0f} tok/s "
                      f"{common.fmt(row['frac_copy'], '.1%')} copy BW", flush=True)
            out = common.write_results("llamacpp_cuda", args, payload)
    print(f"\nwrote {out}")
    print(f"{SOURCE}; build {'reused' if build_s is None else f'{build_s:.0f} s'}; ceilings: "
          f"copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s")
    common.print_table(
        f"llama.cpp on {common.device_name()} ({args.model}; bytes = tensors but token_embd "
        "+ f16 KV at the mean context)",
        [r for r in rows if "step_ms" in r],
        [("mix", "mix", ""), ("test", "test", ""), ("batch", "batch", "d"),
         ("ms/step", "step_ms", ".2f"), ("tok/s", "tok_per_s", ".0f"),
         ("W MB", "weight_MB", ".0f"), ("KV MB", "kv_MB", ".1f"), ("GB/s", "GBps", ".0f"),
         ("copy", "frac_copy", ".1%"), ("TFLOP/s", "TFLOPs", ".1f"),
         ("matmul", "frac_matmul", ".1%")])


if __name__ == "__main__":
    main()
