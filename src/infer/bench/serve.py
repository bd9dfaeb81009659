"""A server under load: streaming /v1/completions on the OpenAI wire format, as a client
sees them (the server may be infer's or any OpenAI-compatible one that takes ignore_eos).

Per request: TTFT (send -> first chunk with text), ITL (gaps between chunks with text; a
chunk may carry more than one token when the server batches the text of several steps),
end-to-end latency, and the output tokens of the final usage chunk
(`stream_options.include_usage`). A request fails on an HTTP status, a stream error event,
a missing [DONE] or usage chunk, or fewer tokens than max_tokens (ignore_eos is set)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

from infer.bench.http_client import HttpClient, HttpError


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds."""

    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def send(client: HttpClient, model: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = Outcome(start=time.perf_counter())
    last: float | None = None
    done, usage = False, None
    try:
        async with client.request("POST", "/v1/completions", body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                out.error = f"HTTP {r.status}: {text[:200]}"
                return out
            async for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue  # read to the end: the connection is reused
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error'].get('message')}"
                    return out
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    if last is None:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last)
                    last = now
                usage = chunk.get("usage") or usage
    except (OSError, HttpError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out.e2e = time.perf_counter() - out.start
    if not done or usage is None:
        out.error = "stream ended without " + ("[DONE]" if not done else "a usage chunk")
        return out
    out.prompt_tokens, out.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    if out.output_tokens != max_tokens:
        out.error = f"{out.output_tokens} output tokens, expected {max_tokens}"
    return out


async def send_all(client: HttpClient, model: str, prompts: list[str], max_tokens: int,
                   max_concurrency: int | None = None, request_rate: float = math.inf,
                   seed: int = 0) -> tuple[list[Outcome], float]:
    """Every prompt, arriving as a Poisson process of `request_rate` a second (inf: all at
    once), at most `max_concurrency` in flight; (outcomes in prompt order, wall seconds)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals, at = [], 0.0
    for _ in prompts:
        arrivals.append(at)
        if math.isfinite(request_rate):
            at += rng.expovariate(request_rate)
    t0 = time.perf_counter()

    async def one(prompt: str, at: float) -> Outcome:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if limit is None:
            return await send(client, model, prompt, max_tokens)
        async with limit:
            return await send(client, model, prompt, max_tokens)

    outcomes = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, arrivals)))
    return list(outcomes), time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    itl = [gap for o in ok for gap in o.itl]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    out_tokens = sum(o.output_tokens for o in ok)

    def pcts(xs: list[float]) -> dict[str, float | None]:
        return {f"p{q}": percentile(xs, q) for q in (50, 90, 99)} | {
            "mean": sum(xs) / len(xs) if xs else None}

    return {
        "requests": len(outcomes), "completed": len(ok), "errors": len(outcomes) - len(ok),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:5],
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "seconds": wall, "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (prompt_tokens + out_tokens) / wall, "req_per_s": len(ok) / wall,
        "ttft_s": pcts(ttft), "itl_s": pcts(itl), "e2e_s": pcts(e2e),
        "per_request": [{"ttft": o.ttft, "e2e": o.e2e, "output_tokens": o.output_tokens,
                         "chunks": len(o.itl) + (o.ttft is not None), "error": o.error}
                        for o in outcomes],
    }


async def first_model(client: HttpClient) -> str:
    return (await client.get_json("/v1/models"))["data"][0]["id"]


def report(summary: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f}"

    t, i = summary["ttft_s"], summary["itl_s"]
    rows = [("successful requests", summary["completed"]),
            ("failed requests", summary["errors"]),
            ("duration (s)", f"{summary['seconds']:.2f}"),
            ("prompt tokens", summary["prompt_tokens"]),
            ("output tokens", summary["output_tokens"]),
            ("requests/s", f"{summary['req_per_s']:.2f}"),
            ("output tok/s", f"{summary['output_tok_per_s']:.1f}"),
            ("total tok/s", f"{summary['total_tok_per_s']:.1f}"),
            ("TTFT mean / p50 / p99 (ms)", f"{ms(t['mean'])} / {ms(t['p50'])} / {ms(t['p99'])}"),
            ("ITL mean / p50 / p99 (ms)", f"{ms(i['mean'])} / {ms(i['p50'])} / {ms(i['p99'])}")]
    return "\n".join(f"{name:<30}{value:>24}" for name, value in rows)
