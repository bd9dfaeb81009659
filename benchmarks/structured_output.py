"""What a constraint costs per decode step: the same requests plain and under a regex and a
JSON-schema constraint, at several batch sizes, through the engine with `LLM` defaults
(CUDA graphs, async scheduling), its start-up heap frozen as the server's core freezes
its own (`setup.freeze_startup_objects`). Random weights in a model shape, with a real vocabulary
(`--tokenizer`, a directory with tokenizer.json) so that the grammars are real; 64
constrained JSON answers are checked first (stopped ones must parse and fit the schema).
Then the time to first token of one request under a JSON schema never seen before (its
grammar compiled on the request's path) and under the same schema again (cached), beside
an unconstrained one.

"decode ms/step" times the steps once every request of the batch is decoding (its
grammar's matcher made, its prompt in the cache); "whole run ms/step" divides the run
from the first request added to the last finished, admission and prefill included, by
its steps.

    python benchmarks/structured_output.py --tokenizer DIR [--batches 1 32 256] [--rounds 5]
        [--engine grammar_process=true] [--stall-dump-ms 150] [--cpus-apart] [--loop-phases]

With the grammar worker on (the default with CUDA), the loop's own time in its calls
(queueing a step's masks, handing over its ids, reading the verdicts) is printed as well;
with --loop-phases, the loop's host time in each phase of a step (`loop_phases.py`).

Prints one table and writes benchmarks/results/structured_output_<device>.json.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import faulthandler
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import cpu_placement
import loop_phases
from timing import wrap_timed

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}


# Objects in an array that cannot close within the 128 tokens timed: every row is
# constrained for its whole run, as the regex `[a-z ]+` is.
NOTES = {"type": "object", "required": ["notes"], "properties": {"notes": {
    "type": "array", "minItems": 100, "items": {
        "type": "object", "required": ["title", "score"], "properties": {
            "title": {"type": "string"}, "score": {"type": "integer"}}}}}}


def _valid_person(text: str) -> bool:
    record = json.loads(text)
    return (set(record) == {"name", "age"} and isinstance(record["name"], str)
            and len(record["name"]) <= 10 and isinstance(record["age"], int)
            and 0 <= record["age"] <= 99)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-3.2-1b")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5,
                   help="runs of each constraint, interleaved; the median is reported")
    p.add_argument("--stall-dump-ms", type=float, default=0,
                   help="print every thread's Python stack when a timed decode step has "
                   "run this long (faulthandler; 0: off)")
    p.add_argument("--cpus-apart", action="store_true",
                   help="the step loop on one CPU, every other thread (the grammar "
                   "worker's too) off that CPU's physical core (cpu_placement.py; Linux)")
    p.add_argument("--loop-phases", action="store_true",
                   help="time the step loop's phases in the timed runs (loop_phases.py)")
    common.add_common_args(p)
    args = p.parse_args()
    from infer import SamplingParams, StructuredOutputsParams

    path = common.get_checkpoint(args.model_shape, args.tiny, args.ckpt_root,
                                 tokenizer_dir=Path(args.tokenizer))
    flags = {"max_num_seqs": max(args.batches), **common.parse_engine_flags(args.engine)}
    llm, _ = common.build_llm(path, flags)
    from infer.engine.setup import freeze_startup_objects
    freeze_startup_objects()  # as the server's core process does (no collection stalls)
    # handed back at exit, so that Triton's bindings see their objects freed
    atexit.register(gc.unfreeze)
    worker_calls = _time_worker_calls()  # stays empty where the worker is off
    phases = loop_phases.LoopPhases() if args.loop_phases else None
    _watch_compiles()
    person = [SamplingParams(max_tokens=64, temperature=0.8, seed=i,
                             structured_outputs=StructuredOutputsParams(json=PERSON))
              for i in range(64)]
    outs = llm.generate(["A record:"] * 64, person, use_tqdm=False)
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    valid = sum(_valid_person(text) for text in stopped)
    print(f"JSON answers: {len(stopped)}/64 stopped, {valid} valid", flush=True)
    placement = {"pinned": False, "threads_per_core": cpu_placement.threads_per_core()}
    if args.cpus_apart:
        worker = llm.engine.core.grammars.process
        if worker is None:
            p.error("--cpus-apart needs the grammar worker (grammar_process=true)")
        placement = cpu_placement.apart([process.pid for process in worker.processes])
    print(f"CPU placement: {placement}", flush=True)
    constraints = {"none": None,
                   "regex [a-z ]+": StructuredOutputsParams(regex="[a-z ]+"),
                   "JSON schema": StructuredOutputsParams(json=NOTES)}
    vocab = llm.engine.info.vocab_size  # the tokenizer's, which the checkpoint took
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(32)]}
                   for _ in range(batch)]
        params = {name: [SamplingParams(max_tokens=args.output_len, temperature=0.8, seed=i,
                                        ignore_eos=True, structured_outputs=constraint)
                          for i in range(batch)]
                  for name, constraint in constraints.items()}
        for name in constraints:
            llm.generate(prompts[:2], params[name][:2], use_tqdm=False)  # warm
        runs: dict[str, list[dict]] = {name: [] for name in constraints}
        names = list(constraints)
        for r in range(args.rounds):  # interleaved, the order turned each round
            for name in names[r % len(names):] + names[:r % len(names)]:
                if phases is not None:
                    phases.label = f"{batch} {name}"
                runs[name].append(_timed_run(llm.engine, prompts, params[name],
                                             args.output_len // 2, args.stall_dump_ms / 1e3))
                if phases is not None:
                    phases.label = None
        for name, measured in runs.items():
            decode = sorted(m["decode_ms"] for m in measured)
            whole = sorted(m["whole_ms"] for m in measured)
            rows.append({"batch": batch, "constraint": name, "tokens": measured[0]["tokens"],
                         "ms_per_step": decode[len(decode) // 2], "ms_per_step_runs": decode,
                         "whole_run_ms_per_step": whole[len(whole) // 2],
                         "out_tok_per_s": sorted(m["tok_per_s"]
                                                 for m in measured)[len(measured) // 2],
                         # per run: requests the grammar ended early, its slowest and
                         # median decode step (a stall shows in the first against the second)
                         "stopped_runs": [m["stopped"] for m in measured],
                         "slowest_step_ms_runs": [m["slowest_step_ms"] for m in measured],
                         "median_step_ms_runs": [m["median_step_ms"] for m in measured],
                         # which decode step was slowest, in which one a request first
                         # stopped (None: none did), and the Triton compiles of the run
                         "slowest_step_runs": [m["slowest_step"] for m in measured],
                         "first_stop_step_runs": [m["first_stop_step"] for m in measured],
                         "compiled_runs": [m["compiled"] for m in measured]})
    ttft = _first_token_times(llm, SamplingParams, StructuredOutputsParams)
    plain = {r["batch"]: r for r in rows if r["constraint"] == "none"}
    print("| batch | constraint | decode ms/step (median) | runs | vs none | paired vs none "
          "| whole run ms/step | vs none | out tok/s |\n"
          "|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = plain[r["batch"]]
        r["vs_none"] = r["ms_per_step"] / base["ms_per_step"]
        # each round's run against the plain run of the same round (their median steps):
        # what the host's drift over a process's rounds moves less
        r["paired_vs_none"] = statistics.median(
            a / b for a, b in zip(r["median_step_ms_runs"], base["median_step_ms_runs"]))
        r["whole_run_vs_none"] = r["whole_run_ms_per_step"] / base["whole_run_ms_per_step"]
        runs = " ".join(f"{ms:.2f}" for ms in r["ms_per_step_runs"])
        print(f"| {r['batch']} | {r['constraint']} | {r['ms_per_step']:.2f} | {runs} "
              f"| {r['vs_none']:.2f}x | {r['paired_vs_none']:.2f}x "
              f"| {r['whole_run_ms_per_step']:.2f} "
              f"| {r['whole_run_vs_none']:.2f}x | {r['out_tok_per_s']:,.0f} |")
    _per_run_table(rows, "each run in order: median step / slowest step ms (requests "
                   "stopped by their grammar)", ", ", lambda m, x, n: f"{m:.2f} / {x:.2f} ({n})",
                   "median_step_ms_runs", "slowest_step_ms_runs", "stopped_runs")
    _per_run_table(rows, "each run: slowest step's index, first stop's, Triton compiles",
                   "; ", lambda i, j, c: f"{i}, {j}, {','.join(c) or '-'}",
                   "slowest_step_runs", "first_stop_step_runs", "compiled_runs")
    print("| first token of one request | ms (median of 5) |\n|---|---:|")
    for name, ms in ttft.items():
        print(f"| {name} | {ms:.2f} |")
    calls = _worker_call_table(worker_calls, args.batches) if worker_calls else []
    loop = phases.table() if phases is not None else []
    common.write_results("structured_output", args, {
        "json_stopped": len(stopped), "json_valid": valid, "rows": rows, "ttft_ms": ttft,
        "grammar_worker_calls": calls, "cpu_placement": placement, "loop_phases": loop})


COMPILED: list[str] = []  # Triton kernels compiled in this process, in order


def _watch_compiles() -> None:
    """Record each Triton compile (a launch's first of a new specialization: a few hundred
    ms on the step loop) in COMPILED."""
    try:
        import triton
    except ImportError:
        return

    def hook(*, fn, **_) -> None:
        COMPILED.append(fn.name)
    triton.knobs.runtime.jit_post_compile_hook = hook


def _timed_run(engine, prompts: list, params: list, decode_steps: int,
               stall_dump_s: float = 0) -> dict:
    """One batch through the engine's step loop: the decode steps timed apart (once every
    request has a token, `decode_steps` of them), and the whole run. With `stall_dump_s`,
    every thread's stack is printed when a timed step has run that long."""
    from infer import RequestOutputKind

    params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
    steps_before = engine.stats()["num_steps"]
    compiled_before = len(COMPILED)
    common.sync()
    start = time.perf_counter()
    ids = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
    tokens = stopped = 0
    step_ms: list[float] = []  # each decode step's wall time, as the loop saw it
    first_stop = None  # the decode step in which a request first stopped

    def step() -> None:
        nonlocal tokens, stopped, first_stop
        finished = [o for o in engine.step() if o.finished]
        tokens += sum(len(o.outputs[0].token_ids) for o in finished)
        for o in finished:  # a failed request would leave the loop below waiting forever
            if o.outputs[0].finish_reason in ("error", "abort"):
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            stopped += o.outputs[0].finish_reason == "stop"
            if stopped and first_stop is None:
                first_stop = len(step_ms)

    while not (len(engine.scheduler.running) == len(ids)
               and all(r.output_token_ids for r in engine.scheduler.running)):
        step()
        if tokens:  # one finished before the last was admitted: no step has them all
            raise RuntimeError(f"a request finished before all {len(ids)} were decoding "
                               "(their grammars' matchers came slower than a whole answer)")
    common.sync()
    decode_start = last = time.perf_counter()
    for _ in range(decode_steps):  # the device not awaited
        if stall_dump_s:
            faulthandler.dump_traceback_later(stall_dump_s)
        step()
        if stall_dump_s:
            faulthandler.cancel_dump_traceback_later()
        now = time.perf_counter()
        step_ms.append((now - last) * 1e3)
        last = now
    common.sync()
    decode = time.perf_counter() - decode_start
    while engine.has_unfinished_requests():
        step()
    common.sync()
    seconds = time.perf_counter() - start
    steps = engine.stats()["num_steps"] - steps_before
    slowest = max(range(len(step_ms)), key=step_ms.__getitem__)
    return {"decode_ms": decode / decode_steps * 1e3, "whole_ms": seconds / steps * 1e3,
            "tok_per_s": tokens / seconds, "tokens": tokens, "stopped": stopped,
            "slowest_step_ms": step_ms[slowest], "slowest_step": slowest,
            "first_stop_step": first_stop,
            "median_step_ms": sorted(step_ms)[len(step_ms) // 2],
            "compiled": COMPILED[compiled_before:]}


def _per_run_table(rows: list[dict], what: str, sep: str, cell, *keys: str) -> None:
    """A table of one line per batch and constraint: `cell` of each run's `keys` values."""
    print(f"| batch | constraint | {what} |\n|---:|---|---|")
    for r in rows:
        runs = sep.join(cell(*values) for values in zip(*(r[k] for k in keys)))
        print(f"| {r['batch']} | {r['constraint']} | {runs} |")


def _time_worker_calls() -> list[tuple[str, int, float]]:
    """Where the grammar worker is on: (call, rows, host ms) of each of the grammar worker's
    calls on the step loop (the loop's own cost of a constrained step); rows: those masked
    (`masks`, `verdicts`) or sampled (`publish`)."""
    from infer.engine.grammar_process import GrammarProcess

    calls: list[tuple[str, int, float]] = []
    for name in ("masks", "publish", "verdicts"):
        wrap_timed(GrammarProcess, name, lambda seconds, args, name=name: calls.append(
            (name, len(args[-1]), seconds * 1e3)))
    return calls


def _worker_call_table(calls: list[tuple[str, int, float]], batches: list[int]) -> list:
    """Median host ms of each call at each batch size (calls with 90-100 % of the batch's
    rows masked), printed and returned."""
    out = []
    print("| batch | grammar worker's calls on the loop | host ms (median) | calls |\n"
          "|---:|---|---:|---:|")
    for batch in batches:
        for name in ("masks", "publish", "verdicts"):
            ms = sorted(t for n, rows, t in calls if n == name and 0.9 * batch <= rows <= batch)
            if ms:
                out.append({"batch": batch, "call": name, "ms": ms[len(ms) // 2],
                            "calls": len(ms)})
                print(f"| {batch} | {name} | {ms[len(ms) // 2]:.3f} | {len(ms)} |")
    return out


def _first_token_times(llm, SamplingParams, StructuredOutputsParams) -> dict[str, float]:
    """Median ms for one 32-token prompt to its first token: unconstrained, under a JSON
    schema new to the engine (a property name no earlier schema had), and under the same
    schema again."""
    def timed(constraint) -> float:
        params = SamplingParams(max_tokens=1, structured_outputs=constraint)
        common.sync()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(100, 132))}], params, use_tqdm=False)
        common.sync()
        return (time.perf_counter() - t) * 1e3

    times: dict[str, list[float]] = {"none": [], "cold schema": [], "cached schema": []}
    for i in range(5):
        schema = {**PERSON, "properties": {**PERSON["properties"],
                                           f"field_{i}": {"type": "string"}}}
        times["none"].append(timed(None))
        times["cold schema"].append(timed(StructuredOutputsParams(json=schema)))
        times["cached schema"].append(timed(StructuredOutputsParams(json=schema)))
    return {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}


if __name__ == "__main__":
    main()
