"""The server's own cost per token, with the model taken out: `infer serve`'s app and
request side over a stand-in core (a process that answers every running sequence with
one token per step after `--step-ms`, no model), driven by streaming clients in other
processes. What the server process spends (CPU seconds, all threads; the receiving
thread apart) per generated token and per request is what limits a real server once the
core is fast, and it is the same on a CPU as beside a GPU.

    python benchmarks/server_overhead.py --streams 256 --output-len 256 --step-ms 5

Prints one table and writes benchmarks/results/server_overhead_<device>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import serve_bench
import serve_vs_offline


class InstantCore:
    """Stands in for EngineCore in a CoreLoop: each step (after `step_s`) gives every
    sequence the next token of a fixed text, until its max_new_tokens."""

    def __init__(self, token_ids: list[int], step_s: float) -> None:
        self.token_ids, self.step_s = token_ids, step_s
        self.sequences: dict = {}
        self.on_step_start = None
        self.num_steps = 0

    def add(self, request, params) -> None:
        self.sequences[request.request_id] = request

    def finish(self, seq_id: str, reason: str, stop_reason=None) -> None:
        self.sequences.pop(seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def unfinished_ids(self) -> list[str]:
        return list(self.sequences)

    def step(self) -> list:
        from infer.engine.engine_core import SequenceOutput

        if self.on_step_start is not None:
            self.on_step_start()
        time.sleep(self.step_s)
        self.num_steps += 1
        outputs = []
        for seq_id, request in list(self.sequences.items()):
            token = self.token_ids[len(request.output_token_ids) % len(self.token_ids)]
            request.output_token_ids.append(token)
            done = len(request.output_token_ids) >= request.max_new_tokens
            outputs.append(SequenceOutput(seq_id, [token], None, None,
                                          "length" if done else None, None, 0))
            if done:
                del self.sequences[seq_id]
        return outputs

    def stats(self) -> dict:
        return {"num_requests_running": len(self.sequences), "num_requests_waiting": 0,
                "kv_blocks_used": 0, "num_steps": self.num_steps}


def _core_main(conn, token_ids: list[int], step_s: float) -> None:
    from infer.engine.core_process import CoreLoop

    CoreLoop(InstantCore(token_ids, step_s), conn).run()


def _thread_cpu(threads: dict[str, threading.Thread]) -> dict[str, float]:
    """CPU seconds each thread has used so far (Linux: per-thread clocks)."""
    return {name: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            for name, t in threads.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4, help="client processes")
    p.add_argument("--http", choices=["limited-h11", "h11", "httptools"], default="limited-h11",
                   help="the HTTP protocol: infer serve's (h11 with connection limits), or "
                   "uvicorn's own (for comparison)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the event loop's thread; print the top functions")
    p.add_argument("--delivery-wait-s", type=float, default=None,
                   help="override AsyncEngine's DELIVERY_WAIT_S (0: deliver without waiting "
                   "for the loop)")
    p.add_argument("--profile-sort", default="tottime", help="pstats sort key")
    p.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer decodes (default: the embedded SmolLM2)")
    common.add_common_args(p)
    args = p.parse_args()
    import uvicorn

    from infer.engine.config import EngineConfig
    from infer.engine.core_loading import CoreInfo
    from infer.engine.core_process import CoreClient
    from infer.engine.setup import freeze_startup_objects, load_tokenizer
    from infer.server import AsyncEngine, async_engine, build_app
    from infer.server.connections import limited_protocol

    if args.delivery_wait_s is not None:
        async_engine.DELIVERY_WAIT_S = args.delivery_wait_s
    tokenizer = load_tokenizer(args.tokenizer)  # a real BPE: real text, real decoding
    text_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it "
                                "runs back home for supper. " * 4, False)
    ctx = get_context("spawn")
    conn, child = ctx.Pipe()
    core = ctx.Process(target=_core_main, args=(child, text_ids, args.step_ms / 1e3))
    core.start()
    child.close()
    info = CoreInfo("stand-in", 4096, tokenizer.vocab_size, 10**6, 16, "none", "none",
                    "none", "none", 0.0)
    engine = AsyncEngine(CoreClient(conn, core), tokenizer, info, EngineConfig())
    threads = {"event_loop": threading.main_thread(), "receiving": engine._receiver}
    freeze_startup_objects()  # as infer serve does
    port = serve_bench._free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "m"), host="127.0.0.1",
                                          port=port, log_level="warning",
                                          http=limited_protocol() if args.http ==
                                          "limited-h11" else args.http))
    specs = serve_vs_offline.burst(args.streams, args.prompt_len, args.output_len, 1000)
    result: dict = {}

    def load() -> None:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        serve_vs_offline.drive(url, specs[:4], 1)  # clients and server warm
        before = _thread_cpu(threads)
        cpu = time.process_time()
        records, _ = serve_vs_offline.drive(url, specs, args.clients)  # no core counters
        result["cpu_s"] = time.process_time() - cpu
        after = _thread_cpu(threads)
        result["threads_s"] = {name: after[name] - before[name] for name in threads}
        result.update(serve_vs_offline.summarize(records, args.output_len))
        server.should_exit = True

    threading.Thread(target=load, daemon=True).start()
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    server.run()
    engine.shutdown()
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats(args.profile_sort).print_stats(45)
    tokens = result["output_tokens"]
    row = {"streams": args.streams, "http": args.http,
           "delivery_wait_s": async_engine.DELIVERY_WAIT_S, "output_len": args.output_len,
           "step_ms": args.step_ms,
           "out_tok_per_s": result["out_tok_per_s"], "errors": result["errors"],
           "tokens_per_chunk": result["tokens_per_chunk"],
           "server_cpu_us_per_token": result["cpu_s"] / tokens * 1e6,
           **{f"{name}_thread_us_per_token": seconds / tokens * 1e6
              for name, seconds in result["threads_s"].items()},
           "core_bound_tok_per_s": args.streams / (args.step_ms / 1e3)}
    print("| streams | step ms | out tok/s (core alone) | server CPU µs/token | event loop "
          "| receiving thread | tokens/chunk | errors |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.streams} | {args.step_ms} | {row['out_tok_per_s']:,.0f} "
          f"({row['core_bound_tok_per_s']:,.0f}) | {row['server_cpu_us_per_token']:.1f} "
          f"| {row['event_loop_thread_us_per_token']:.1f} "
          f"| {row['receiving_thread_us_per_token']:.1f} | {row['tokens_per_chunk']:.2f} "
          f"| {row['errors']} |")
    common.write_results("server_overhead", args, row)


if __name__ == "__main__":
    main()
