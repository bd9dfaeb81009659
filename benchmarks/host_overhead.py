"""Host time per sequence per decode step: everything LLMEngine.step() does besides the
model forward (scheduling, input preparation, sampling-batch building, detokenizing and
stop checks, outputs). It is the same Python on a CPU as next to a GPU, where it is time
the GPU idles, so it is measured here on a tiny model whose forward is timed apart.

    python benchmarks/host_overhead.py --batch 256 --output-len 512 [--output-kind delta]
        [--temperature 0.6 [--seeded]] [--tokenizer DIR --constraint regex|json]
        [--engine NAME=VALUE ...] [--stub-device]

With --stub-device the model's forward, its logits and the sampling return fixed tensors
at once (every row samples token 1000, or where a grammar does not allow it the lowest
token it does): what is left is the host's own work, free of the CPU's matmuls and of
the torch sampler's passes over the vocabulary.

Prints the split per phase and writes benchmarks/results/host_overhead_<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from timing import wrap_timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--output-kind", choices=["final", "delta", "cumulative"], default="final",
                   help="final: LLM.generate's; delta: the server's; cumulative: LLM.stream's")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seeded", action="store_true", help="a seed per request")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (a real vocabulary, "
                   "which --constraint needs)")
    p.add_argument("--constraint", choices=["none", "regex", "json"], default="none",
                   help="every request under structured_output.py's regex or JSON schema")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                   help="engine flag passed to LLM(...) (repeatable)")
    p.add_argument("--stub-device", action="store_true",
                   help="forward, logits and sampling stubbed out (the host's work alone)")
    p.add_argument("--ckpt-root")
    p.add_argument("--suffix", default="")
    p.add_argument("--results-dir", default=str(common.RESULTS))
    p.set_defaults(tiny=True)  # the model is always the tiny one (results_path says so)
    args = p.parse_args()
    torch.set_num_threads(1)
    from structured_output import NOTES

    from infer import RequestOutputKind, SamplingParams, StructuredOutputsParams
    from infer.engine import engine_core

    if args.constraint != "none" and not args.tokenizer:
        p.error("--constraint needs --tokenizer (a real vocabulary)")
    path = common.get_checkpoint("llama-3.2-1b", True, args.ckpt_root,
                                 tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None)
    blocks = args.batch * -(-(args.prompt_len + args.output_len) // 16)
    llm, _ = common.build_llm(path, {
        "max_model_len": args.prompt_len + args.output_len, "max_num_seqs": args.batch,
        "device": "cpu", "dtype": "float32", "num_blocks": blocks,
        **common.parse_engine_flags(args.engine)})
    constraint = {"none": None, "regex": StructuredOutputsParams(regex="[a-z ]+"),
                  "json": StructuredOutputsParams(json=NOTES)}[args.constraint]
    engine = llm.engine
    if args.stub_device:
        _stub_device(engine, engine_core, args.batch)
    phases: collections.Counter[str] = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        wrap_timed(owner, name, lambda seconds, _: phases.update({label: seconds}))

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.scheduler, "schedule_ahead", "schedule (launched ahead)")
    timed(engine.scheduler, "update", "scheduler update (+ token stops)")
    timed(engine.runner, "prepare", "prepare inputs")
    timed(engine.runner, "forward", "model forward (not host)")
    timed(engine.core, "_sampling_batch", "sampling batch")
    timed(engine_core, "sample", "sample")
    timed(engine.output_processor, "_apply", "detokenize + stop strings")
    timed(engine.output_processor, "_output", "build outputs")
    if constraint is not None:
        from infer.engine.grammar_process import GrammarProcess
        from infer.engine.structured_output import StructuredOutputs
        timed(engine.core, "_advance_grammars", "grammars: advance (+ verdicts)")
        timed(StructuredOutputs, "sampler_masks", "grammars: masks on the loop")
        timed(GrammarProcess, "masks", "grammars: worker's masks")
        timed(GrammarProcess, "publish", "grammars: publish tokens")
    vocab = engine.model_config.vocab_size
    kind = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
            "cumulative": RequestOutputKind.CUMULATIVE}[args.output_kind]
    for i in range(args.batch):
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                                ignore_eos=True, output_kind=kind,
                                seed=i if args.seeded else None,
                                structured_outputs=constraint)
        engine.add_request(f"r{i}", [(11 * i + j) % vocab for j in range(args.prompt_len)],
                           params)
    while any(not s.request.output_token_ids for s in engine.core.sequences.values()):
        engine.step()  # prefill
    phases.clear()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    host = wall - phases["model forward (not host)"]
    per_seq = host / steps / args.batch * 1e6
    rows = [(label, seconds / steps * 1e3, seconds / steps / args.batch * 1e6)
            for label, seconds in phases.most_common()]
    common.write_results("host_overhead", args, {
        "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "output_kind": args.output_kind, "temperature": args.temperature,
        "seeded": args.seeded, "constraint": args.constraint, "steps": steps,
        "host_us_per_seq_step": per_seq,
        "phases_ms_per_step": {label: ms for label, ms, _ in rows}})
    print(f"\nbatch {args.batch}, {steps} decode steps, {args.output_kind} outputs, "
          f"constraint {args.constraint}: host "
          f"{host / steps * 1e3:.2f} ms/step = {per_seq:.1f} us per sequence per step")
    print("| phase | ms/step | us/seq/step |\n|---|---:|---:|")
    for label, ms, us in rows:
        print(f"| {label} | {ms:.3f} | {us:.1f} |")


def _stub_device(engine, engine_core, rows: int) -> None:
    """Every step's device work replaced by fixed tensors (a step samples at most `rows`
    rows: one per sequence, no drafts here)."""
    from infer.engine.sampler import SamplerOutput

    hidden = torch.zeros(rows, 8)
    engine.runner.forward = lambda inputs, ids=None: hidden[:max(1, len(inputs.sample_rows))]
    engine.runner.sample_logits = lambda h, inputs: h
    engine_core.sample = lambda logits, batch, masks=None: SamplerOutput(
        _stub_tokens(len(logits), masks), None)


STUB_TOKEN = 1000


def _stub_tokens(rows: int, masks: torch.Tensor | None) -> torch.Tensor:
    """Token 1000 for every row, or where a grammar's mask does not allow it, the lowest
    token it allows (`masks`: the sampler's int32 bitmasks, a bit per token)."""
    tokens = np.full(rows, STUB_TOKEN, dtype=np.int64)
    if masks is not None:
        words = masks[:rows].numpy().view(np.uint32)
        barred = np.flatnonzero((words[:, STUB_TOKEN // 32] >> STUB_TOKEN % 32) & 1 == 0)
        if barred.size:
            sub = words[barred]
            first = (sub != 0).argmax(axis=1)
            word = sub[np.arange(len(barred)), first]
            lowest_bit = np.log2(word & (~word + np.uint32(1))).astype(np.int64)
            tokens[barred] = first * 32 + lowest_bit
    return torch.from_numpy(tokens)


if __name__ == "__main__":
    main()
