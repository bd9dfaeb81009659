"""`infer bench offline | serve`: the flags and the two commands."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
from pathlib import Path

from infer.bench.http_client import HttpClient
from infer.bench.offline import rates, time_generate
from infer.bench.prompts import random_token_ids, random_words
from infer.bench.serve import first_model, report, send, send_all, summarize
from infer.flags import add_engine_flags, engine_config


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, a server under load",
                           description="Benchmarks, as `vllm bench`: `infer bench offline` "
                           "runs the offline API (infer.LLM) here; `infer bench serve` loads "
                           "a running server.")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    offline = kinds.add_parser(
        "offline", help="throughput of the offline API (infer.LLM) on synthetic prompts",
        description="NUM_PROMPTS prompts of INPUT_LEN random token ids, each generating "
        "exactly OUTPUT_LEN tokens (ignore_eos), in one LLM.generate call after a short "
        "warm-up; prints requests/s, output and total tokens/s. --seed seeds the prompts too.")
    _workload_flags(offline, "prompt tokens per request", seed=False)  # the engine's seeds
    offline.add_argument("--temperature", type=float, default=0.0,
                         help="0 samples greedily (default: 0)")
    add_engine_flags(offline)
    offline.set_defaults(func=cmd_offline)
    serve = kinds.add_parser(
        "serve", help="load a running OpenAI-compatible server (infer serve, vLLM, ...)",
        description="NUM_PROMPTS streaming /v1/completions of INPUT_LEN random words (about "
        "a token each), each generating exactly OUTPUT_LEN tokens (ignore_eos), arriving at "
        "REQUEST_RATE with at most MAX_CONCURRENCY in flight; prints TTFT and inter-token "
        "latency percentiles, tokens/s and failures. Exits 1 if a request failed.")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="the server (default: http://127.0.0.1:8000)")
    serve.add_argument("--model", default=None,
                       help="model name to request (default: the first of /v1/models)")
    serve.add_argument("--api-key", default=os.environ.get("INFER_API_KEY"),
                       help="sent as `Authorization: Bearer KEY` (default: $INFER_API_KEY)")
    _workload_flags(serve, "words per prompt (about a token each; the server's usage "
                    "counts give the exact prompt tokens)")
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="most requests in flight (default: no limit)")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second, Poisson arrivals (default: inf, all at once)")
    serve.add_argument("--num-warmups", type=int, default=1,
                       help="short requests sent first, not measured (default: 1)")
    serve.add_argument("--timeout", type=float, default=600.0,
                       help="seconds a connect or read may wait (default: 600)")
    serve.set_defaults(func=cmd_serve)


def _workload_flags(parser: argparse.ArgumentParser, input_help: str, seed: bool = True
                    ) -> None:
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="requests (default: 100)")
    parser.add_argument("--input-len", type=int, default=128,
                        help=f"{input_help} (default: 128)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens per request (default: 128)")
    if seed:
        parser.add_argument("--seed", type=int, default=0,
                            help="seed of the prompts and arrivals (default: 0)")
    parser.add_argument("--output-json", type=Path, default=None, metavar="PATH",
                        help="also write the results there as JSON")


def _check_workload(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def cmd_offline(args: argparse.Namespace) -> int:
    from infer.llm import LLM

    _check_workload(args)
    config = engine_config(args)
    llm = LLM(**dataclasses.asdict(config))
    rng = random.Random(args.seed)
    prompts = [random_token_ids(rng, args.input_len, llm.engine.info.vocab_size)
               for _ in range(args.num_prompts)]
    result = time_generate(llm, prompts, [args.output_len] * args.num_prompts,
                           args.temperature)
    result |= rates(result)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['total_tok_per_s']:.2f} total tokens/s, "
          f"{result['output_tok_per_s']:.2f} output tokens/s "
          f"({result['requests']} requests, {result['prompt_tokens']} prompt and "
          f"{result['output_tokens']} output tokens in {result['seconds']:.2f} s)")
    if result["output_tokens"] != result["expected_output_tokens"]:
        print(f"infer: warning: {result['output_tokens']} output tokens, expected "
              f"{result['expected_output_tokens']}", file=sys.stderr)
    _write_json(args.output_json, {
        "benchmark": "offline", "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "seed": args.seed, **result,
        "engine": dataclasses.asdict(llm.engine.info), "config": dataclasses.asdict(config)})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    _check_workload(args)
    summary, model = asyncio.run(_serve(args))
    print(f"{args.num_prompts} requests to {args.base_url} ({model}): {args.input_len} words "
          f"in, {args.output_len} tokens out, concurrency {args.max_concurrency or 'unlimited'}"
          f", rate {args.request_rate:g}/s")
    print(report(summary))
    for error in summary["error_samples"]:
        print(f"infer: error: {error}", file=sys.stderr)
    _write_json(args.output_json, {
        "benchmark": "serve", "base_url": args.base_url, "model": model,
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed, **summary})
    return 1 if summary["errors"] else 0


async def _serve(args: argparse.Namespace) -> tuple[dict, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = HttpClient(args.base_url, headers, args.timeout)
    try:
        model = args.model or await first_model(client)
        for i in range(args.num_warmups):
            await send(client, model, f"warm up {i}", 4)
        rng = random.Random(args.seed)
        prompts = [random_words(rng, args.input_len) for _ in range(args.num_prompts)]
        outcomes, wall = await send_all(client, model, prompts, args.output_len,
                                        args.max_concurrency, args.request_rate, args.seed)
    finally:
        await client.close()
    return summarize(outcomes, wall), model


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        print(f"wrote {path}", file=sys.stderr)
