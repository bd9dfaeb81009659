"""The grammar worker's own time per step, on the host alone (no model, no device).

A constrained step cannot sample until the worker has fed every row the token it sampled
a step before and filled its next mask (`engine/grammar_worker.py`); at 256 rows that
work is as long as the forward it must hide under. This times it where it runs, for each
thread count of the grammar library:

- the real `Worker` filling and feeding `rows` rows of the structured-output benchmark's
  JSON schema (`structured_output.NOTES`, compiled as the engine compiles it), each row
  fed a token drawn from its own mask (as random weights pick: anything allowed);
- the library's calls alone, on matchers of their own, steps alternating between three
  ways of doing a step's consume + fill: the tokens consumed on the library's threads
  (`consume_token_par`, the worker's way from FEED_PAR_ROWS rows) then the masks filled;
  consumed one by one, then filled; and in two halves overlapped (half A consumed, then
  filled on a second thread while half B is consumed, then half B filled): what a worker
  that overlapped them would take;
- two processes at once, each consuming and filling half the rows (on its library's
  threads, each with half the threads): what two workers would take (the slower half's
  time, step by step).

    python benchmarks/grammar_worker.py [--rows 32 256] [--threads 0 4 8 16] [--steps 60]
    python benchmarks/grammar_worker.py --tokenizer DIR   # tokenizer.json + _config.json

Without --tokenizer, SmolLM2's vocabulary from its model package (as the tests find it).
Prints a table and writes benchmarks/results/grammar_worker_<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from structured_output import NOTES

MODES = ("parallel", "one by one", "halves overlapped")


def load_tokenizer(directory: str | None):
    from infer.loader.tokenizer import Tokenizer

    if directory:
        return Tokenizer.from_hf_dir(directory)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from real_models import smollm2_gguf

    return Tokenizer.from_gguf(smollm2_gguf())


def draw_tokens(masks: np.ndarray, vocab: int, rng: np.random.Generator) -> list[int]:
    """One allowed token per row of `masks` (the library's bitmask words), at random."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return [int(rng.choice(np.flatnonzero(row))) for row in bits]


def time_worker(lib_tokenizer, grammar: str, vocab: int, rows: int, threads: int,
                steps: int, warm: int) -> dict:
    """Median ms of the real Worker's fill and feed of `rows` rows."""
    import llguidance

    from infer.engine import grammar_worker as gw

    words = (vocab + 31) // 32
    layout = gw.SharedLayout(memoryview(bytearray(gw.SharedLayout.size(rows, words))),
                             rows, words)
    worker = gw.Worker(layout, lib_tokenizer, llguidance.LLExecutor(threads or None), None,
                       False)
    for m in range(rows):
        worker.matchers[m] = llguidance.LLMatcher(lib_tokenizer, grammar, log_level=0)
    ids, rng = np.arange(rows), np.random.default_rng(0)
    fills, feeds = [], []
    for step in range(1, steps + 1):
        slot = step % gw.FILL_SLOTS
        layout.requests[slot] = (rows, rows, step - 1)
        layout.request_ids[slot, :rows], layout.request_rows[slot, :rows] = ids, ids
        layout.header[gw.TOKENS_STAMP] = step - 1
        start = time.perf_counter()
        worker.fill(step)
        filled = time.perf_counter()
        layout.tokens[:rows] = draw_tokens(layout.masks[:rows], vocab, rng)
        layout.header[gw.TOKENS_STAMP] = step
        fed = time.perf_counter()
        worker.feed(*worker.pending)
        if step > warm:
            fills.append(filled - start)
            feeds.append(time.perf_counter() - fed)
    return dict(worker_fill_ms=1e3 * statistics.median(fills),
                worker_feed_ms=1e3 * statistics.median(feeds))


class LibraryRows:
    """`rows` matchers of the grammar library, their masks (filled once) and an executor
    of `threads` threads (0: its default), driven without the worker."""

    def __init__(self, lib_tokenizer, grammar: str, vocab: int, rows: int,
                 threads: int) -> None:
        import llguidance

        self.vocab, self.rows = vocab, rows
        self.executor = llguidance.LLExecutor(threads or None)
        self.matchers = [llguidance.LLMatcher(lib_tokenizer, grammar, log_level=0)
                         for _ in range(rows)]
        self.pairs = [(m, row) for row, m in enumerate(self.matchers)]
        self.masks = np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)
        self.fill(self.pairs)

    def fill(self, pairs: list) -> None:
        """The next masks of `pairs` (matcher, row)."""
        self.executor.unsafe_compute_mask_ptr(
            pairs, self.masks.__array_interface__["data"][0], 4 * self.masks.shape[1],
            self.rows)

    def feeding(self, rng: np.random.Generator) -> list[tuple[object, int]]:
        """Each matcher with a token its mask allows, at random."""
        return list(zip(self.matchers, draw_tokens(self.masks, self.vocab, rng)))


class FillThread:
    """A second thread that fills masks when asked (the overlapped halves' half A)."""

    def __init__(self, library: LibraryRows) -> None:
        self.library = library
        self.pairs: list = []
        self.asked, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            self.library.fill(self.pairs)
            self.done.set()

    def start(self, pairs: list) -> None:
        self.pairs = pairs
        self.done.clear()
        self.asked.set()


def time_library(lib_tokenizer, grammar: str, vocab: int, rows: int, threads: int,
                 steps: int, warm: int) -> dict:
    """Median ms of a step's consume + fill, each of MODES (steps alternate)."""
    library = LibraryRows(lib_tokenizer, grammar, vocab, rows, threads)
    executor, pairs = library.executor, library.pairs
    helper, half = FillThread(library), rows // 2
    rng = np.random.default_rng(0)
    spent: dict[str, list[float]] = {mode: [] for mode in MODES}
    parts: dict[str, list[float]] = {"fill": [], "consume parallel": [],
                                     "consume one by one": []}
    for step in range(steps * len(MODES)):
        feeding = library.feeding(rng)
        mode = MODES[step % len(MODES)]
        start = time.perf_counter()
        if mode == "halves overlapped":
            executor.consume_token_par(feeding[:half])
            helper.start(pairs[:half])
            executor.consume_token_par(feeding[half:])
            library.fill(pairs[half:])
            helper.done.wait()
        else:
            if mode == "parallel":
                executor.consume_token_par(feeding)
            else:
                for matcher, token in feeding:
                    matcher.consume_token(token)
            consumed = time.perf_counter()
            library.fill(pairs)
        end = time.perf_counter()
        if step >= warm * len(MODES):
            spent[mode].append(end - start)
            if mode != "halves overlapped":
                parts[f"consume {mode}"].append(consumed - start)
                parts["fill"].append(end - consumed)
        if any(m.is_stopped() or m.is_error() for m in library.matchers):
            raise SystemExit("a matcher finished or failed: the schema must outlast --steps")
    return {**{f"{mode} ms": 1e3 * statistics.median(v) for mode, v in spent.items()},
            **{f"{name} ms": 1e3 * statistics.median(v) for name, v in parts.items()}}


def _half_worker(lib_json: str, vocab: int, eos: list[int], grammar: str, rows: int,
                 threads: int, steps: int, barrier, results) -> None:
    """One of `time_two_processes`' processes: its rows' consume + fill, step by step,
    each step started with the other process's."""
    import llguidance

    lib_tokenizer = llguidance.LLTokenizer(lib_json, n_vocab=vocab, eos_token=eos)
    library = LibraryRows(lib_tokenizer, grammar, vocab, rows, threads)
    rng, spent = np.random.default_rng(rows), []
    for _ in range(steps):
        feeding = library.feeding(rng)
        barrier.wait()
        start = time.perf_counter()
        library.executor.consume_token_par(feeding)
        library.fill(library.pairs)
        spent.append(time.perf_counter() - start)
    results.put(spent)


def time_two_processes(lib_json: str, vocab: int, eos: list[int], grammar: str, rows: int,
                       threads: int, steps: int, warm: int) -> dict:
    """Median over steps of the slower process's consume + fill, two processes of half
    the rows (and half the library's threads) each running at once."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    halves = [context.Process(target=_half_worker, args=(
        lib_json, vocab, eos, grammar, rows // 2, threads // 2, steps, barrier, results))
        for _ in range(2)]
    for process in halves:
        process.start()
    first, second = results.get(), results.get()
    for process in halves:
        process.join()
    slower = [max(a, b) for a, b in zip(first, second)][warm:]
    return {"two processes ms": 1e3 * statistics.median(slower)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[0, 4, 8, 16],
                   help="the grammar library's threads (0: its default)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warm", type=int, default=10, help="first steps not timed")
    common.add_common_args(p)
    args = p.parse_args()
    import llguidance

    from infer.engine.structured_output import StructuredOutputs, library_tokenizer_json
    from infer.sampling_params import StructuredOutputsParams

    tokenizer = load_tokenizer(args.tokenizer)
    vocab = tokenizer.vocab_size
    grammar = StructuredOutputs(tokenizer, vocab).compile(StructuredOutputsParams(json=NOTES))
    lib_json, eos = library_tokenizer_json(tokenizer), list(tokenizer.eos_token_ids)
    lib_tokenizer = llguidance.LLTokenizer(lib_json, n_vocab=vocab, eos_token=eos)
    results = []
    for rows in args.rows:
        for threads in args.threads:
            row = dict(rows=rows, threads=str(threads or "default"),
                       **time_worker(lib_tokenizer, grammar, vocab, rows, threads,
                                     args.steps, args.warm),
                       **time_library(lib_tokenizer, grammar, vocab, rows, threads,
                                      args.steps, args.warm),
                       **time_two_processes(lib_json, vocab, eos, grammar, rows, threads,
                                            args.steps, args.warm))
            results.append(row)
            print(row, flush=True)
            common.write_results("grammar_worker", args, {"rows": results})
    common.print_table(
        "the grammar worker's step on the host (JSON schema rows, ms)", results,
        [("rows", "rows", "d"), ("threads", "threads", "s"),
         ("worker fill", "worker_fill_ms", ".3f"), ("worker feed", "worker_feed_ms", ".3f"),
         ("lib fill", "fill ms", ".3f"), ("consume par", "consume parallel ms", ".3f"),
         ("consume 1 by 1", "consume one by one ms", ".3f"),
         *[(f"step: {mode}", f"{mode} ms", ".3f") for mode in MODES],
         ("step: two processes", "two processes ms", ".3f")])


if __name__ == "__main__":
    main()
