"""Serving benchmark: the five workloads of workloads.py through `infer bench serve`'s
streaming client (infer.bench.serve, which says what it measures per request: TTFT, ITL,
end-to-end latency, output tokens, failures). Per workload: output tokens / wall time,
completed requests / wall time, percentiles, and every failure.

    # start `infer serve` with the engine flags after `--`, run everything, stop it
    python benchmarks/serve_bench.py --launch --scale 0.25 --tag cpu -- --device cpu
    # or against a running OpenAI-compatible server (vLLM takes the same requests)
    python benchmarks/serve_bench.py --server http://127.0.0.1:8000 --workload prefix_caching

Prints one table last and writes benchmarks/results/serve_<tag>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workloads import NAMES, RequestSpec, Workload, build

from infer.bench import serve
from infer.bench.http_client import HttpClient, HttpError
from infer.bench.serve import Outcome, send

RESULTS = Path(__file__).parent / "results"


async def run_workload(client: HttpClient, model: str, wl: Workload):
    t0 = time.perf_counter()
    if wl.sequential:
        outcomes = [await send(client, model, spec.prompt, spec.max_tokens)
                    for spec in wl.requests]
    else:
        async def at(spec: RequestSpec) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + spec.at - time.perf_counter()))
            return await send(client, model, spec.prompt, spec.max_tokens)

        outcomes = list(await asyncio.gather(*(at(spec) for spec in wl.requests)))
    return outcomes, time.perf_counter() - t0


def summarize(wl: Workload, outcomes: list[Outcome], wall: float) -> dict:
    return {"workload": wl.name, "measures": wl.measures, "pattern": wl.pattern,
            "max_tokens": wl.requests[0].max_tokens, **serve.summarize(outcomes, wall)}


async def server_stats(client: HttpClient) -> dict[str, float] | None:
    """infer's /stats (prefix-cache hits, preemptions); None on servers without it."""
    with contextlib.suppress(OSError, HttpError, ValueError):
        return await client.get_json("/stats")
    return None


async def bench(args: argparse.Namespace, url: str) -> tuple[str, list[dict]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = HttpClient(url, headers, args.timeout)
    try:
        model = args.model or await serve.first_model(client)
        for i in range(args.warmup):  # first requests pay one-off costs
            await send(client, model, f"warm up {i}", 4)
        results = []
        for name in args.workload:
            wl = build(name, args.scale, args.seed)
            print(f"{name}: {len(wl.requests)} requests, {wl.pattern} ...", file=sys.stderr)
            before = await server_stats(client)
            outcomes, wall = await run_workload(client, model, wl)
            result = summarize(wl, outcomes, wall)
            after = await server_stats(client)
            if before is not None and after is not None:
                result["server_stats_delta"] = {
                    k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                      "num_preemptions", "prompt_tokens_total",
                                                      "generation_tokens_total") if k in after}
            results.append(result)
            for error in result["error_samples"]:
                print(f"  error: {error}", file=sys.stderr)
    finally:
        await client.close()
    return model, results


# -- the server ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(engine_flags: list[str], threads: int | None, log: Path,
             timeout: float) -> Iterator[str]:
    """`infer serve` in a subprocess (this Python), until /health is 200; stopped after."""
    port = _free_port()
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", *engine_flags]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"infer serve exited with {proc.returncode}:\n"
                                       + log.read_text()[-2000:])
                with contextlib.suppress(OSError):  # urllib's errors included
                    if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"infer serve not healthy after {timeout} s; see {log}")
                time.sleep(0.5)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def environment(args: argparse.Namespace) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat(),
           "server": "launched here" if args.launch else args.server}
    try:
        import torch

        env["torch"] = torch.__version__
        env["device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                         else _cpu_name())
    except ImportError:
        env["device"] = _cpu_name()
    return env


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    return "CPU: " + (platform.processor() or "unknown")


# -- report -------------------------------------------------------------------------------
def table(results: list[dict]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    head = ("| workload | requests | errors | seconds | out tok/s | req/s | TTFT p50/p90/p99 ms "
            "| ITL p50/p90/p99 ms | E2E p50 s |")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        t, i, e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        e2e = "-" if e["p50"] is None else f"{e['p50']:.2f}"
        rows.append(
            f"| {r['workload']} | {r['requests']} | {r['errors']} | {r['seconds']:.1f} "
            f"| {r['output_tok_per_s']:.1f} | {r['req_per_s']:.2f} "
            f"| {ms(t['p50'])} / {ms(t['p90'])} / {ms(t['p99'])} "
            f"| {ms(i['p50'])} / {ms(i['p90'])} / {ms(i['p99'])} | {e2e} |")
    return "\n".join(rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ours, engine_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="engine flags for --launch go after `--`")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="base URL of a running server")
    where.add_argument("--launch", action="store_true", help="start `infer serve` here")
    p.add_argument("--workload", nargs="+", default=list(NAMES), choices=NAMES)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies request counts, arrival rates and lengths (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("INFER_API_KEY"))
    p.add_argument("--tag", default="local", help="writes results/serve_<tag>.json")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--timeout", type=float, default=1800, help="per-request seconds")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the launched server (1 is best on a busy CPU)")
    p.add_argument("--launch-timeout", type=float, default=600)
    args = p.parse_args(ours)
    if args.scale <= 0:
        p.error("--scale must be positive")
    if engine_flags and not args.launch:
        p.error("engine flags after `--` need --launch")
    args.engine_flags = engine_flags
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = RESULTS / f"serve_{args.tag}.json"
    if args.launch:
        log = Path(tempfile.gettempdir()) / f"infer_serve_{args.tag}.log"
        print(f"infer serve {' '.join(args.engine_flags)} (log: {log})", file=sys.stderr)
        with launched(args.engine_flags, args.threads, log, args.launch_timeout) as url:
            model, results = asyncio.run(bench(args, url))
    else:
        model, results = asyncio.run(bench(args, args.server.rstrip("/")))
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    specs = {name: [asdict(s) | {"prompt": None} for s in build(name, args.scale, args.seed)
                    .requests] for name in args.workload}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "model": model, "environment": environment(args),
                               "workload_requests": specs, "results": results}, indent=1))
    errors = sum(r["errors"] for r in results)
    print(f"\nmodel {model}, scale {args.scale}, seed {args.seed}; JSON in {out}"
          + (f"; {errors} FAILED REQUESTS" if errors else "; every request succeeded"))
    print(table(results))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
