"""Does the server deliver the engine's speed? The same requests through `LLM.generate` and
through `infer serve` (streaming), same engine flags, same run.

A burst of N requests (token-id prompts, greedy, `ignore_eos`), and optionally the
prefill-pressure workload (48 requests at 6/s, 75 % with 2,000-token prompts). The client
is several processes (one Python event loop would be the bottleneck at 30k tokens/s).
ITL is the gap between a stream's chunks; a chunk may carry more than one token when the
server falls behind the core (tokens/chunk says how many). The client processes open a
connection per request (kept alive) and then start together (a barrier); "latest send" is
how far behind its schedule the latest request went out (a client too slow to send the
burst at once makes a server look slow). `steps` are
the engine steps the server's core ran for the workload (its /stats).

    python benchmarks/serve_vs_offline.py --model-shape llama-3.2-1b --seqs 64 256 \\
        --servers core-process core-thread [--old-root .ab/pre11] [--pressure] [--rounds 3]
    python benchmarks/serve_vs_offline.py --tiny --engine device=cpu --num-requests 16 ...

Prints one table and writes benchmarks/results/serve_vs_offline_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

Spec = tuple[list[int], int, float]  # prompt ids, max_tokens, seconds after the start


def burst(n: int, prompt_len: int, output_len: int, vocab: int) -> list[Spec]:
    rng = random.Random(0)
    return [([rng.randrange(10, vocab) for _ in range(prompt_len)], output_len, 0.0)
            for _ in range(n)]


def pressure(vocab: int, long_len: int = 2000, scale: float = 1.0) -> list[Spec]:
    """48 requests at 6/s; 75 % of them with long prompts, the rest 64 tokens; 128 out."""
    rng = random.Random(1)
    n = max(4, round(48 * scale))
    long_ids = set(rng.sample(range(n), round(0.75 * n)))
    return [([rng.randrange(10, vocab) for _ in range(long_len if i in long_ids else 64)],
             max(4, round(128 * scale)), i / 6.0) for i in range(n)]


# -- offline --------------------------------------------------------------------------
def run_offline(path: Path, flags: dict, specs: list[Spec]) -> dict:
    from infer import SamplingParams

    llm, _ = common.build_llm(path, flags)
    warm = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 4
    llm.generate([{"prompt_token_ids": s[0]} for s in specs[:4]], warm, use_tqdm=False)
    params = [SamplingParams(max_tokens=s[1], temperature=0, ignore_eos=True) for s in specs]
    common.sync()
    steps = llm.engine.stats()["num_steps"]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s[0]} for s in specs], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats()["num_steps"] - steps
    del llm
    common.free_memory()
    return {"seconds": seconds, "output_tokens": tokens, "out_tok_per_s": tokens / seconds,
            "steps": steps}


# -- the client -----------------------------------------------------------------------
def _client_process(url: str, model: str, specs: list[Spec], t0: float | None) -> list[dict]:
    """`t0`: the time `specs`' offsets count from (None: open the connections, then agree
    on it with the other client processes)."""
    import httpx

    async def one(client: httpx.AsyncClient, spec: Spec, t0: float) -> dict:
        ids, max_tokens, at = spec
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        start = time.time()  # "late": how far behind its schedule the request went out
        rec = {"start": start, "late": start - t0 - at, "chunks": [], "tokens": 0,
               "error": None}
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec["error"] = chunk["error"]["message"]
                    elif chunk.get("usage"):
                        rec["tokens"] = chunk["usage"]["completion_tokens"]
                    elif any(c.get("text") for c in chunk["choices"]):
                        rec["chunks"].append(time.time())
        except httpx.HTTPError as exc:
            rec["error"] = repr(exc)
        finally:
            rec["end"] = time.time()
        return rec

    async def main() -> list[dict]:
        n = len(specs) + 4
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            start = t0
            if start is None:  # open a connection per request, then start with the others
                await asyncio.gather(*(client.get("/health") for _ in specs))
                _BARRIER[0].wait()
                start = time.time() + 0.05
            return await asyncio.gather(*(one(client, s, start) for s in specs))

    return asyncio.run(main())


# With --client-cpus K the client processes run on the host's last K CPUs and everything
# else (the offline engine, the server and its core) on the others, so neither side's CPU
# time is taken from the other, as when clients are other machines.
CLIENT_CPUS: set[int] = set()
_BARRIER: list = []  # in a client process: where it waits for the others


def _start_client(cpus: set[int], barrier) -> None:
    """A client process's start: its CPUs and its imports. Its requests start once every
    client process has opened its connections (at the barrier), so that a burst starts in
    all of them at once: spawning and importing take most of a second on a busy host, and
    a connection's set-up is not the server's serving."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    import httpx  # noqa: F401

    _BARRIER.append(barrier)


def pin_cpus(client_cpus: int) -> str:
    """Split the CPUs this process may use between the clients and the rest (inherited by
    every process it starts); a line saying how."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < client_cpus < len(cpus):
        raise SystemExit(f"--client-cpus must be between 1 and {len(cpus) - 1}")
    CLIENT_CPUS.update(cpus[-client_cpus:])
    os.sched_setaffinity(0, cpus[:-client_cpus])
    return (f"CPUs: server and offline engine {len(cpus) - client_cpus}, clients "
            f"{client_cpus}")


CORE_COUNTERS = ("num_steps", "core_input_seconds", "core_step_seconds",
                 "core_output_seconds")


def _core_counters(url: str) -> dict[str, float]:
    import httpx

    stats = httpx.get(url + "/stats").json()
    return {name: stats.get(name, 0.0) for name in CORE_COUNTERS}


def drive(url: str, specs: list[Spec], clients: int) -> tuple[list[dict], dict[str, float]]:
    """Every request's record, and what the server's core counted for them (its steps and
    where its loop's time went)."""
    import httpx

    models = httpx.get(url + "/v1/models")
    if models.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {models.status_code}: {models.text[:500]}")
    model = models.json()["data"][0]["id"]
    _client_process(url, model, [(s[0], 8, 0.0) for s in specs[:4]], time.time())  # warm-up
    before = _core_counters(url)
    shares = [share for i in range(clients) if (share := specs[i::clients])]
    ctx = get_context("spawn")
    with ProcessPoolExecutor(len(shares), mp_context=ctx, initializer=_start_client,
                             initargs=(CLIENT_CPUS, ctx.Barrier(len(shares)))) as pool:
        jobs = [pool.submit(_client_process, url, model, share, None) for share in shares]
        records = [rec for job in jobs for rec in job.result()]
    time.sleep(0.1)  # the core sends its counters when it goes idle
    after = _core_counters(url)
    return records, {name: after[name] - before[name] for name in CORE_COUNTERS}


def summarize(records: list[dict], expected_tokens: int) -> dict:
    errors = [r["error"] for r in records if r["error"]]
    short = sum(r["tokens"] != expected_tokens for r in records)
    start, end = min(r["start"] for r in records), max(r["end"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["chunks"][0] - r["start"] for r in records if r["chunks"]]
    itl = [b - a for r in records for a, b in zip(r["chunks"], r["chunks"][1:])]
    chunks = sum(len(r["chunks"]) for r in records)
    return {"seconds": end - start, "output_tokens": tokens,
            "max_late_s": max(r["late"] for r in records),
            "out_tok_per_s": tokens / (end - start), "errors": len(errors),
            "first_error": errors[0] if errors else None, "short": short,
            "tokens_per_chunk": tokens / max(chunks, 1),
            "ttft_s": _pcts(ttft), "itl_s": _pcts(itl)}


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None}
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return {"p50": statistics.median(xs), "p99": q[98]}


@contextlib.contextmanager
def _pythonpath(root: str | None):
    """`infer serve` from another tree (an older commit) when `root` is given."""
    old = os.environ.get("PYTHONPATH")
    if root is not None:
        os.environ["PYTHONPATH"] = str(Path(root).resolve() / "src") + (
            os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def run_server(kind: str, path: Path, flags: list[str], specs: list[Spec], clients: int,
               expected: int, old_root: str | None, results_dir: Path) -> dict:
    import serve_bench

    server_flags = ["--model", str(path), *flags]
    if kind == "core-thread":
        server_flags.append("--no-core-process")
    elif kind.startswith("api-"):  # core process, this many API server processes
        server_flags += ["--api-server-count", kind.removeprefix("api-")]
    log = results_dir / f"serve_vs_offline_{kind}.log"
    with _pythonpath(old_root if kind == "old" else None), \
            serve_bench.launched(server_flags, None, log, 900) as url:
        records, core = drive(url, specs, clients)
    summary = summarize(records, expected)
    steps = int(core["num_steps"])
    per_step = {name.removeprefix("core_").removesuffix("_seconds"): value / max(steps, 1) * 1e3
                for name, value in core.items() if name != "num_steps"}
    return {**summary, "steps": steps, "step_ms": summary["seconds"] / max(steps, 1) * 1e3,
            "core_ms_per_step": per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-3.2-1b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seqs", nargs="*", default=["64", "256"],
                   help="max_num_seqs settings to run, the same for both paths ('default': "
                   "each path's own default: the server sizes its batch to the device)")
    p.add_argument("--servers", nargs="*", default=["core-process", "core-thread"],
                   choices=["core-process", "core-thread", "old", "api-1", "api-2", "api-4"],
                   help="core-process: the server's defaults; api-N: the core process and N API "
                   "server processes")
    p.add_argument("--old-root", help="tree of an older commit, for --servers old")
    p.add_argument("--pressure", action="store_true",
                   help="also the prefill-pressure workload (core-process, the server's "
                   "defaults plus --engine flags)")
    p.add_argument("--rounds", type=int, default=1,
                   help="offline then the servers, this many times per --seqs setting; the "
                   "ratios' medians are printed last")
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--client-cpus", type=int, default=0,
                   help="run the clients on the last K CPUs and the rest on the others "
                   "(0: no pinning)")
    common.add_common_args(p)
    args = p.parse_args()
    if args.client_cpus:
        print(pin_cpus(args.client_cpus), flush=True)
    path = common.get_checkpoint(args.model_shape, args.tiny, args.ckpt_root)
    vocab = common.load_shape(args.model_shape, args.tiny)["vocab_size"]
    user = common.parse_engine_flags(args.engine)
    specs = burst(args.num_requests, args.prompt_len, args.output_len, vocab)
    results_dir = Path(args.results_dir)
    rows = []
    for seqs, rnd in itertools.product(args.seqs, range(1, args.rounds + 1)):
        flags = dict(user) if seqs == "default" else {**user, "max_num_seqs": int(seqs)}
        cli = common.cli_flags(flags)
        offline = run_offline(path, flags, specs)
        step_ms = offline["seconds"] / offline["steps"] * 1e3
        rows.append({"max_num_seqs": seqs, "round": rnd, "path": "LLM.generate", **offline,
                     "step_ms": step_ms})
        print(f"[offline] seqs {seqs}, round {rnd}: {offline['out_tok_per_s']:.0f} tok/s, "
              f"{step_ms:.2f} ms/step", flush=True)
        for kind in args.servers:
            r = run_server(kind, path, cli, specs, args.clients, args.output_len,
                           args.old_root, results_dir)
            r["vs_offline"] = r["out_tok_per_s"] / offline["out_tok_per_s"]
            r["itl_p50_vs_step"] = (r["itl_s"]["p50"] or 0) * 1e3 / step_ms
            rows.append({"max_num_seqs": seqs, "round": rnd, "path": f"infer serve ({kind})",
                         **r})
            print(f"[serve {kind}] seqs {seqs}, round {rnd}: {r['out_tok_per_s']:.0f} tok/s "
                  f"({r['vs_offline']:.0%} of offline), errors {r['errors']}; the core's "
                  "loop per step (ms): " + ", ".join(
                      f"{k} {v:.2f}" for k, v in r["core_ms_per_step"].items()), flush=True)
    if args.pressure:
        pspecs = pressure(vocab, scale=0.125 if args.tiny else 1.0,
                          long_len=64 if args.tiny else 2000)
        cli = common.cli_flags(user)
        r = run_server("core-process", path, cli, pspecs, args.clients, pspecs[0][1],
                       None, results_dir)
        r["itl_p99_over_p50"] = (r["itl_s"]["p99"] or 0) / (r["itl_s"]["p50"] or 1)
        rows.append({"max_num_seqs": "default", "path": "prefill pressure (serve)", **r})
    print(_table(rows))
    medians = _medians(rows)
    for m in medians:
        print(f"median over {m['rounds']} rounds, seqs {m['max_num_seqs']}, {m['path']}: "
              f"{m['vs_offline']:.0%} of offline (rounds: "
              + ", ".join(f"{x:.0%}" for x in m["each"]) + ")")
    common.write_results("serve_vs_offline", args, {"rows": rows, "medians": medians,
                                                    "num_requests":
                                                    args.num_requests, "prompt_len":
                                                    args.prompt_len, "output_len":
                                                    args.output_len})


def _medians(rows: list[dict]) -> list[dict]:
    """Per max_num_seqs and server: the median of the rounds' ratios to the offline run
    just before each (the host's speed drifts between runs: a ratio of neighbours)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if "vs_offline" in r:
            groups.setdefault((r["max_num_seqs"], r["path"]), []).append(r["vs_offline"])
    return [{"max_num_seqs": seqs, "path": path, "rounds": len(each), "each": each,
             "vs_offline": statistics.median(each)} for (seqs, path), each in groups.items()]


def _pct(row: dict) -> str:
    if row["path"] == "LLM.generate":
        return "100%"
    return f"{row['vs_offline']:.0%}" if "vs_offline" in row else "-"


def _table(rows: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    out = ["| max_num_seqs | round | path | out tok/s | vs offline | steps | ms/step "
           "| ITL p50 / p99 ms | TTFT p50 / p99 ms | tokens/chunk | errors | latest send ms |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        itl, ttft = r.get("itl_s", {}), r.get("ttft_s", {})
        out.append(
            f"| {r['max_num_seqs']} | {r.get('round', '-')} | {r['path']} "
            f"| {r['out_tok_per_s']:,.0f} "
            f"| {_pct(r)} | {r['steps']} | {r['step_ms']:.2f} "
            f"| {ms(itl.get('p50'))} / {ms(itl.get('p99'))} "
            f"| {ms(ttft.get('p50'))} / {ms(ttft.get('p99'))} "
            f"| {r.get('tokens_per_chunk', 1.0):.2f} | {r.get('errors', 0)} "
            f"| {r.get('max_late_s', 0) * 1e3:.0f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
