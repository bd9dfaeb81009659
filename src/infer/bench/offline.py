"""The offline API's throughput: a batch of prompts through `LLM.generate`, ignore_eos,
so that every request produces exactly its output length."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.llm import LLM


def time_generate(llm: LLM, prompts: list[list[int]], output_lens: list[int],
                  temperature: float = 0.0) -> dict:
    """Generate for every prompt (token ids) its output length after a short warm-up
    (the first calls pay one-off costs), timed until `generate` returns: every token has
    then reached the host. Returns the counts and seconds."""
    from infer.sampling_params import SamplingParams

    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
              for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": output_tokens, "expected_output_tokens": sum(output_lens),
            "seconds": seconds}


def rates(result: dict) -> dict:
    """requests/s, output and total tokens/s of a `time_generate` result."""
    seconds = result["seconds"]
    return {"requests_per_s": result["requests"] / seconds,
            "output_tok_per_s": result["output_tokens"] / seconds,
            "total_tok_per_s": (result["prompt_tokens"] + result["output_tokens"]) / seconds}
