"""Decode speed on the CPU by weight format, with llama.cpp on the same GGUF file in the
same run: the embedded SmolLM2 (or --model) dequantized (`quantization=none`), kept as the
file stores it (`auto`, the default) through infer's block kernels (`auto+int8x`, x in
int8) and through PyTorch's (`auto+torch`), and INT8 made at load (`int8`); greedy,
`ignore_eos`, batch 1 and 8, each path with its default threads. A format `Q+int8x` /
`Q+torch` is `quantization=Q` with `cpu_int8_activations` on / off; the table says which
one `auto` takes on this CPU.

    python benchmarks/cpu_quantized.py [--peer-python /path/to/venv/bin/python] [--rounds 3]
        [--prompt-lens 500 2000]

`--prompt-lens` also times the first token of prompts of that many token ids (random ids,
new ones each round so that no prefix is cached; llama.cpp with a context that fits them).

The peer is llama-cpp-python (a build of llama.cpp), run as its users run it: `Llama(path)`
with its defaults, tokens from `Llama.generate` at temperature 0, timed over the same
number of tokens after the prompt. It is not a dependency of infer: `--peer-python` names
an interpreter that has it (the rounds alternate between the paths, so a change in the
machine's load shows in both). Prints one table and writes
benchmarks/results/cpu_quantized_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

PROMPT = "Once upon a time"

PEER = r"""
import json, sys, time
from llama_cpp import Llama
path, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, verbose=False)
prompt = llm.tokenize(sys.argv[4].encode())
rates = []
for _ in range(rounds + 1):  # the first is a warm-up
    llm.reset()
    count, start = 0, None
    for _token in llm.generate(prompt, temp=0.0):
        if start is None:
            start = time.perf_counter()  # the prompt is evaluated: time the decode
        count += 1
        if count == n + 1:
            break
    rates.append(n / (time.perf_counter() - start))
ttft = {}
for n in json.loads(sys.argv[5]):
    big = Llama(path, verbose=False, n_ctx=n + 64)
    for r in range(rounds):
        ids = [(7919 * (i + 1) + 104729 * r) % 40000 + 100 for i in range(n)]
        big.reset()
        start = time.perf_counter()
        big.eval(ids)
        ttft.setdefault(n, []).append(time.perf_counter() - start)
print(json.dumps({"rates": rates[1:], "n_threads": llm.n_threads, "ttft": ttft}))
"""


def engine_args(fmt: str) -> dict:
    """LLM(...)'s arguments for a format: `quantization[+int8x|+torch]`."""
    quantization, _, kernels = fmt.partition("+")
    args: dict = {"quantization": quantization}
    if kernels:
        args["cpu_int8_activations"] = {"int8x": True, "torch": False}[kernels]
    return args


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--formats", nargs="+", default=["none", "auto+int8x", "auto+torch", "int8"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer-python", help="an interpreter with llama-cpp-python installed")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[],
                   help="also time the first token of prompts of these many tokens")
    common.add_common_args(p)
    args = p.parse_args()
    from infer import LLM, SamplingParams
    from infer.loader.default_model import default_model_path

    path = args.model or str(default_model_path())
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    flags = common.parse_engine_flags(args.engine)
    llms = {f: LLM(path, device="cpu", **common.merged_flags(engine_args(f), flags))
            for f in args.formats}
    rates: dict[tuple[str, int], list[float]] = {}
    ttft: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for fmt, llm in llms.items():
            for batch in args.batches:
                llm.generate([PROMPT] * batch, SamplingParams(max_tokens=4), use_tqdm=False)
                start = time.perf_counter()
                outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rates.setdefault((fmt, batch), []).append(
                    tokens / (time.perf_counter() - start))
            for n in args.prompt_lens:
                ids = [(7919 * (i + 1) + 104729 * round_) % 40000 + 100 for i in range(n)]
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1),
                             use_tqdm=False)
                ttft.setdefault((fmt, n), []).append(time.perf_counter() - start)
        if args.peer_python:
            out = subprocess.run([args.peer_python, "-c", PEER, path, str(args.output_len),
                                  "1", PROMPT, json.dumps(args.prompt_lens)],
                                 capture_output=True, text=True, check=True)
            peer = json.loads(out.stdout)
            rates.setdefault(("llama.cpp", 1), []).extend(peer["rates"])
            for n, seconds in peer["ttft"].items():
                ttft.setdefault(("llama.cpp", int(n)), []).extend(seconds)
    rows = []
    peer_rate = statistics.median(rates[("llama.cpp", 1)]) if args.peer_python else None
    for (fmt, batch), values in rates.items():
        rate = statistics.median(values)
        llm = llms.get(fmt)
        rows.append({
            "format": fmt if llm is None else f"infer {fmt} ({llm.engine.info.quantization})",
            "batch": batch, "tok_per_s": rate, "rounds": values,
            "weight_bytes": None if llm is None else weight_bytes(llm.engine.model),
            "vs_llama_cpp": rate / peer_rate if peer_rate else None,
        })
    prompts = [{"path": fmt, "prompt_tokens": n, "ttft_s": statistics.median(values),
                "rounds": values} for (fmt, n), values in ttft.items()]
    from infer.kernels.cpu_block_linear import on_by_default

    auto_takes = "+int8x" if on_by_default() else "+torch"
    common.write_results("cpu_quantized", args, {"rows": rows, "prompts": prompts,
                                                 "model": path, "auto_takes": auto_takes})
    print(f"(auto on this CPU: auto{auto_takes})")
    print("| path | batch | tok/s (median) | vs llama.cpp batch 1 | weights MB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        mb = "-" if r["weight_bytes"] is None else f"{r['weight_bytes'] / 2**20:.0f}"
        vs = "-" if r["vs_llama_cpp"] is None else f"{r['vs_llama_cpp']:.2f}x"
        print(f"| {r['format']} | {r['batch']} | {r['tok_per_s']:.1f} | {vs} | {mb} |")
    if prompts:
        print("\n| path | prompt tokens | time to first token s (median) |")
        print("|---|---:|---:|")
        for r in prompts:
            print(f"| {r['path']} | {r['prompt_tokens']} | {r['ttft_s']:.2f} |")


if __name__ == "__main__":
    main()
