"""Grammar matchers in a process of their own (`EngineConfig.grammar_process`): the engine
gives the same tokens as with matchers on its step loop, the worker's masks are the
library's own, its verdicts say when a grammar finished or refused a token, and a worker
that dies ends only the constrained sequences. On a GPU, the stream memory operations the
device's side of the handshake uses, on pinned host words."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from functools import cache
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_fixtures import drain, make_llm
from reference_tokenizers import ours

from infer.engine.grammar_worker import (
    FAILED,
    FED,
    FILLS,
    MASKS_READY,
    NOTED,
    REFUSED,
    STOPPED,
    TAKEN,
    SharedLayout,
    make_shared,
    serve,
)
from infer.kernels.reference import apply_token_bitmask_ref
from infer.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

PROMPT = "Reply in JSON. A person:"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "tags"]}


def _llm(grammar_process: bool | None, **config):
    return make_llm(num_blocks=256, grammar_process=grammar_process, **config)


def _requests() -> tuple[list[str], list[SamplingParams]]:
    def constrained(seed: int, **kind) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0.8, seed=seed,
                              structured_outputs=StructuredOutputsParams(**kind))

    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    params = [constrained(1, json=SCHEMA), plain, constrained(2, regex=r"[a-c]{2,5}x"),
              constrained(3, choice=["red", "green", "a blue one"]),
              SamplingParams(max_tokens=30, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              constrained(4, json_object=True)]
    return [PROMPT] * len(params), params


@cache
def _on_the_loop(async_scheduling: bool) -> tuple[list[list[int]], list[str]]:
    """`_requests()`' tokens and finish reasons with the matchers on the step loop."""
    prompts, params = _requests()
    outs = _llm(False, async_scheduling=async_scheduling).generate(prompts, params,
                                                                    use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs]


@cache
def _plain_alone() -> list[int]:
    """The tokens of `_requests()`' unconstrained request, alone on an engine."""
    prompts, params = _requests()
    [alone] = _llm(False).generate(prompts[1:2], params[1:2], use_tqdm=False)
    return alone.outputs[0].token_ids


@pytest.mark.parametrize(("async_scheduling", "workers"), [(True, 1), (False, 1), (True, 3)])
def test_the_worker_gives_the_tokens_the_step_loop_gives(async_scheduling, workers):
    prompts, params = _requests()
    llm = _llm(True, async_scheduling=async_scheduling, grammar_workers=workers)
    worker = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    assert core.grammars.process is not None and core.grammars.process.alive()
    assert len(core.grammars.process.processes) == workers
    loop_tokens, loop_reasons = _on_the_loop(async_scheduling)
    assert [o.outputs[0].token_ids for o in worker] == loop_tokens
    assert [o.outputs[0].finish_reason for o in worker] == loop_reasons
    texts = [o.outputs[0].text for o in worker]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in worker)
    if worker[0].outputs[0].finish_reason == "stop":
        pytest.importorskip("jsonschema").validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,5}x", texts[2]), texts[2]
    assert texts[3] in ("red", "green", "a blue one")
    assert llm.engine.stats()["kv_blocks_used"] == 0
    if async_scheduling:
        assert llm.engine.stats()["num_steps_launched_ahead"] > 0


@pytest.mark.parametrize(("device", "speculative_method", "wanted"), [
    ("cuda", "none", True), ("cpu", "none", False), ("cuda", "ngram", False)])
def test_by_default_the_worker_runs_with_cuda_and_without_drafts(
        device, speculative_method, wanted):
    from types import SimpleNamespace

    from infer.engine.grammar_admission import GrammarAdmission

    admission = SimpleNamespace(device=torch.device(device), config=SimpleNamespace(
        grammar_process=None, speculative_method=speculative_method))
    assert GrammarAdmission._worker_wanted(admission) is wanted
    for explicit in (True, False):
        admission.config.grammar_process = explicit
        assert GrammarAdmission._worker_wanted(admission) is explicit


def test_by_default_a_cpu_engine_keeps_the_matchers_on_its_loop():
    llm = _llm(None)
    [out] = llm.generate([PROMPT], [SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-c]+"))],
        use_tqdm=False)
    assert llm.engine.core.grammars.process is None
    assert re.fullmatch("[a-c]+", out.outputs[0].text)


def test_by_default_two_workers_on_eight_cpus_or_more_else_one():
    """`grammar_workers` None: two workers where the engine may run on 8 CPUs or more (a
    host of 16: 2; of 4: 1), as an engine on this host starts them."""
    from infer.engine.cpu_threads import usable_cores
    from infer.engine.grammar_process import default_workers

    assert [default_workers(n) for n in (1, 4, 7, 8, 16, 64)] == [1, 1, 1, 2, 2, 2]
    llm = _llm(True)
    try:
        llm.generate([PROMPT], [SamplingParams(max_tokens=2, structured_outputs=(
            StructuredOutputsParams(regex="[a-z]+")))], use_tqdm=False)
        processes = llm.engine.core.grammars.process.processes
        assert len(processes) == (2 if usable_cores() >= 8 else 1)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_worker_ends_the_constrained_sequences_only(workers):
    """One worker of `workers` killed: every constrained sequence ends with an error (the
    device waits for every worker's masks), the others go on untouched."""
    prompts, params = _requests()
    llm = _llm(True, grammar_workers=workers)
    up = SamplingParams(max_tokens=2, structured_outputs=params[0].structured_outputs)
    llm.generate(prompts[:1], [up], use_tqdm=False)  # the workers are up
    alone = _plain_alone()
    process = llm.engine.core.grammars.process.processes[-1]
    process.kill()
    process.wait()
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    last = drain(engine)
    for i, p in enumerate(params):
        out = last[f"r{i}"]
        if p.structured_outputs is None:  # untouched, token for token
            assert out.outputs[0].token_ids == alone
            assert out.error is None and out.outputs[0].finish_reason == "length"
        else:
            assert out.outputs[0].finish_reason == "error", out
            assert "grammar worker exited" in out.error
    assert llm.engine.stats()["kv_blocks_used"] == 0
    [after] = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)
    assert after.outputs[0].token_ids == alone


@pytest.fixture(scope="module", params=[1, 2], ids=["one worker", "two workers"])
def worker(request):
    from infer.engine.grammar_process import GrammarProcess
    from infer.engine.structured_output import StructuredOutputs

    tokenizer = ours("smollm2")
    process = GrammarProcess(tokenizer, tokenizer.vocab_size, 4, torch.device("cpu"),
                             workers=request.param)
    yield process, StructuredOutputs(tokenizer, tokenizer.vocab_size)
    process.close()


def test_the_workers_masks_and_verdicts_are_the_librarys(worker):
    """Row masks equal the in-process library's for matchers fed the same tokens, rows
    without a matcher allow everything; a grammar that has taken its whole text is
    finished, a token outside it refused, a grammar the library will not start failed."""
    process, library = worker
    grammars = [library.compile(StructuredOutputsParams(regex=r"ab|cd")),
                library.compile(StructuredOutputsParams(json=SCHEMA))]
    remote = [process.matcher(g) for g in grammars]
    local = [library.matcher(g) for g in grammars]
    tokenizer = ours("smollm2")
    texts = ["ab", '{"name":"x","tags":["a"]}']
    plans = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    vocab = tokenizer.vocab_size
    for i in range(max(map(len, plans))):
        rows = [(row, m) for row, m in zip((0, 2), remote) if i < len(plans[row // 2])]
        logits = torch.zeros(3, vocab)
        step, masks = process.masks(3, rows)
        apply_token_bitmask_ref(logits, masks)
        expected = library.allocate_masks(3)
        library.fill_masks([local[row // 2] for row, _ in rows], expected,
                           [row for row, _ in rows])
        for row in range(3):
            if row in [r for r, _ in rows]:
                assert np.array_equal(process.layout.masks[row], expected[row].numpy())
                assert 0 < torch.isfinite(logits[row]).sum() < vocab
            else:
                assert torch.isfinite(logits[row]).all()
        ids = torch.tensor([plans[row // 2][i] if row != 1 and i < len(plans[row // 2])
                            else 0 for row in range(3)])
        process.publish(step, ids)
        verdicts = process.verdicts(step, rows)
        assert verdicts.refused == [] and verdicts.failed == []
        for row, _ in rows:
            assert local[row // 2].accept(int(ids[row]))
    assert remote[0].terminated and remote[1].terminated
    assert local[0].terminated and local[1].terminated
    fresh = process.matcher(grammars[0])
    broken = process.matcher('{"grammars": [{"lark_grammar": "start: nonsense_rule"}]}')
    masked = [(0, fresh), (1, broken)]
    step, _ = process.masks(2, masked)
    bad = tokenizer.encode("zz", add_special_tokens=False)[0]
    process.publish(step, torch.tensor([bad, bad]))
    verdicts = process.verdicts(step, masked)
    assert verdicts.refused == [0] and verdicts.failed == [1]
    process.drop([fresh, broken, *remote])


def test_grammar_threads_sets_the_workers_thread_count():
    """`EngineConfig.grammar_threads` reaches the library's executor in the worker: four
    threads more there with 5 than with 1 (counted once a step's masks came back)."""
    from infer.engine.grammar_process import GrammarProcess
    from infer.engine.structured_output import StructuredOutputs

    tokenizer = ours("smollm2")
    grammar = StructuredOutputs(tokenizer, tokenizer.vocab_size, 1).compile(
        StructuredOutputsParams(regex="ab"))
    counts = []
    for threads in (1, 5):
        process = GrammarProcess(tokenizer, tokenizer.vocab_size, 1, torch.device("cpu"),
                                 threads)
        try:
            process.masks(1, [(0, process.matcher(grammar))])
            counts.append(len(os.listdir(f"/proc/{process.processes[0].pid}/task")))
        finally:
            process.close()
    assert counts[1] - counts[0] == 4, counts


def test_two_workers_share_out_the_librarys_threads():
    """With `grammar_threads` 0 and two workers each worker's library runs
    `worker_threads` threads: as many as one given that number, more than one given 1
    where the host has CPUs for it."""
    from infer.engine.cpu_threads import usable_cores
    from infer.engine.grammar_process import GrammarProcess, worker_threads
    from infer.engine.structured_output import StructuredOutputs

    tokenizer = ours("smollm2")
    grammar = StructuredOutputs(tokenizer, tokenizer.vocab_size, 1).compile(
        StructuredOutputsParams(regex="ab"))
    share = worker_threads(usable_cores(), 2)  # the CPUs the engine counts
    counts = {}
    for threads in dict.fromkeys((0, share, 1)):  # share may be 1
        process = GrammarProcess(tokenizer, tokenizer.vocab_size, 2, torch.device("cpu"),
                                 threads, workers=2)
        try:
            process.masks(2, [(0, process.matcher(grammar)), (1, process.matcher(grammar))])
            counts[threads] = [len(os.listdir(f"/proc/{p.pid}/task"))
                               for p in process.processes]
        finally:
            process.close()
    assert counts[0] == counts[share], counts
    assert [a - b for a, b in zip(counts[0], counts[1])] == [share - 1] * 2, counts


@pytest.mark.parametrize("apart", [False, True])
def test_grammar_worker_apart_keeps_the_worker_off_the_loops_core(apart):
    """`EngineConfig.grammar_worker_apart`: the worker (and the library's threads it starts)
    may run on every CPU but those of one physical core, the step loop's; without it, on
    all of this process's."""
    from infer.engine.cpu_threads import core_siblings

    mine = os.sched_getaffinity(0)
    if apart and not any(mine - core_siblings(cpu) for cpu in mine):
        pytest.skip("one physical core: nothing to keep the worker apart on")
    llm = _llm(True, grammar_worker_apart=apart)
    try:
        llm.generate([PROMPT], [SamplingParams(max_tokens=4, structured_outputs=(
            StructuredOutputsParams(regex="[a-z]+")))], use_tqdm=False)
        worker = llm.engine.core.grammars.process.processes[0].pid
        threads = [int(tid) for tid in os.listdir(f"/proc/{worker}/task")]
        allowed = {frozenset(os.sched_getaffinity(tid)) for tid in threads}
    finally:
        llm.engine.shutdown()
    if not apart:
        assert allowed == {frozenset(mine)}
        return
    [cpus] = allowed  # every thread alike
    assert cpus < mine and any(cpus == mine - core_siblings(cpu) for cpu in mine)


def test_a_steps_verdicts_survive_the_worker_feeding_the_next_step(worker):
    """With a step launched ahead, the worker may have fed step s+1 (and said something of
    it) before the loop reads step s's verdicts: s's stay readable."""
    process, library = worker
    encode = ours("smollm2").encode
    [ab], [brace], [bad] = (encode(t, add_special_tokens=False) for t in ("ab", "{", "zz"))
    finishing = process.matcher(library.compile(StructuredOutputsParams(regex=r"ab|cd")))
    going_on = process.matcher(library.compile(StructuredOutputsParams(json=SCHEMA)))
    first = [(0, finishing), (1, going_on)]
    step, _ = process.masks(2, first)
    process.publish(step, torch.tensor([ab, brace]))  # row 0 finishes, row 1 takes it
    second = [(1, going_on)]
    next_step, _ = process.masks(2, second)
    process.publish(next_step, torch.tensor([0, bad]))  # row 1 refuses its token
    deadline = time.monotonic() + 10
    while process.layout.lanes[:, FED].min() < next_step and time.monotonic() < deadline:
        time.sleep(1e-3)
    verdicts = process.verdicts(step, first)
    assert verdicts.refused == [] and finishing.terminated and not going_on.terminated
    assert verdicts.stopped == [0]
    assert process.verdicts(next_step, second).refused == [1]
    process.drop([finishing, going_on])


@pytest.mark.parametrize("parallel", [True, False])
def test_a_steps_tokens_reach_the_matchers_as_one_by_one(monkeypatch, parallel):
    """Fed on the executor's threads (many rows) or one by one, each row's verdict is its
    matcher's: finished, taken, refused, finished a step before, or without a matcher."""
    import llguidance

    from infer.engine import grammar_worker
    from infer.engine.structured_output import StructuredOutputs, library_tokenizer_json

    monkeypatch.setattr(grammar_worker, "FEED_PAR_ROWS", 1 if parallel else 10**6)
    tokenizer = ours("smollm2")
    vocab, words, rows = tokenizer.vocab_size, (tokenizer.vocab_size + 31) // 32, 80
    grammar = StructuredOutputs(tokenizer, vocab).compile(StructuredOutputsParams(regex=r"ab|cd"))
    lib_tokenizer = llguidance.LLTokenizer(library_tokenizer_json(tokenizer), n_vocab=vocab,
                                           eos_token=list(tokenizer.eos_token_ids))
    layout = SharedLayout(memoryview(bytearray(SharedLayout.size(rows, words))), rows, words)
    worker = grammar_worker.Worker(layout, lib_tokenizer, llguidance.LLExecutor(), None, False)
    [ab], [a], [bad] = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "a", "zz"))
    for matcher_id in range(rows):
        worker.matchers[matcher_id] = llguidance.LLMatcher(lib_tokenizer, grammar, log_level=0)
    del worker.matchers[5]
    worker.failed.add(5)  # the library refused its grammar
    assert worker.matchers[7].consume_token(ab)  # finished a step before
    ids = list(range(rows))
    row_of = [rows - 1 - m for m in ids]  # a matcher's row is not its id
    for m in ids:
        layout.tokens[row_of[m]] = (ab, a, bad)[m % 3]
    want = [(STOPPED, TAKEN, REFUSED)[m % 3] for m in ids]
    want[5], want[7] = FAILED, STOPPED
    worker.feed(3, ids, row_of)
    assert [int(layout.verdicts[1][row_of[m]]) for m in ids] == want
    assert layout.lanes[0, FED] == 3 and layout.lanes[0, NOTED + 1] == 3


def test_a_step_never_published_is_dropped_by_the_next_fill(worker):
    """A step whose launch failed after its masks (no ids published): the next step's
    masks come without waiting for them, from the matcher as it was, and go on."""
    process, library = worker
    grammar = library.compile(StructuredOutputsParams(regex=r"ab|cd"))
    remote, local = process.matcher(grammar), library.matcher(grammar)
    masked = [(0, remote)]
    process.masks(1, masked)  # never published
    start = time.monotonic()
    step, masks = process.masks(1, masked)
    assert time.monotonic() - start < 2
    expected = library.allocate_masks(1)
    library.fill_masks([local], expected)
    assert np.array_equal(masks[0].numpy(), expected[0].numpy())
    token = ours("smollm2").encode("ab", add_special_tokens=False)[0]
    process.publish(step, torch.tensor([token]))
    verdicts = process.verdicts(step, masked)
    assert verdicts.refused == [] and verdicts.failed == []
    process.drop([remote])


@pytest.mark.parametrize("spin", [False, True])
def test_the_worker_makes_the_matchers_sent_before_a_fill_before_taking_it(spin):
    """A fill (written to the shared block) names matchers whose "make" went down the
    pipe before it: a worker that finds both waiting makes the matcher first, or the row
    would allow every token."""
    from infer.engine.structured_output import StructuredOutputs, library_tokenizer_json

    tokenizer = ours("smollm2")
    vocab, words = tokenizer.vocab_size, (tokenizer.vocab_size + 31) // 32
    library = StructuredOutputs(tokenizer, vocab)
    grammar = library.compile(StructuredOutputsParams(regex=r"ab|cd"))
    name = f"infer-test-{os.getpid()}-{time.monotonic_ns()}"
    block, _ = make_shared(name, SharedLayout.size(1, words))
    layout = SharedLayout(memoryview(block), 1, words)
    layout.header[:] = 0
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send(("make", 7, grammar))
    layout.request_ids[1, 0], layout.request_rows[1, 0] = 7, 0
    layout.requests[1] = (1, 1, 0)  # one row, masked, nothing published
    layout.header[FILLS] = 1
    worker = threading.Thread(target=serve, args=(
        name, 1, words, 1, 0, library_tokenizer_json(tokenizer), vocab,
        list(tokenizer.eos_token_ids), spin, 0, None, reader))
    worker.start()
    deadline = time.monotonic() + 30
    while layout.lanes[0, MASKS_READY] < 1 and time.monotonic() < deadline:
        time.sleep(1e-3)
    writer.close()
    worker.join(timeout=30)
    assert not worker.is_alive() and layout.lanes[0, MASKS_READY] == 1
    expected = library.allocate_masks(1)
    library.fill_masks([library.matcher(grammar)], expected)
    assert np.array_equal(layout.masks[0], expected[0].numpy())
    assert (layout.masks[0] != -1).any()
    # The worker (a thread here) had this process's resource tracker forget the name:
    # opened again it is registered, and unlinked by the object that opened it.
    shared_memory.SharedMemory(name=name).unlink()


def test_a_script_without_a_main_guard_runs_once_and_leaves_no_block(tmp_path):
    """The worker starts in a fresh interpreter: a script that makes an engine at its top
    level (no `if __name__ == "__main__"`) is not run again inside it. Closed, a process
    leaves no shared block behind; never closed (as `LLM(...)` scripts end, without
    shutting their engine down), its block is unlinked when the interpreter exits; and no
    resource tracker warns of either."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from reference_tokenizers import ours
        from infer.engine.grammar_process import GrammarProcess
        print("script body", flush=True)
        tokenizer = ours("smollm2")
        process = GrammarProcess(tokenizer, tokenizer.vocab_size, 1, torch.device("cpu"))
        step, masks = process.masks(1, [])
        print("masks", step, int(masks[0, 0]), flush=True)
        name = process._shm.name
        process.close()
        print("left behind:", os.path.exists("/dev/shm/" + name), flush=True)
        unclosed = GrammarProcess(tokenizer, tokenizer.vocab_size, 1, torch.device("cpu"))
        unclosed.masks(1, [])
        print("unclosed", unclosed._shm.name, flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("script body") == 1, done.stdout
    assert "masks 1 -1" in done.stdout  # a row no matcher names allows every token
    assert "left behind: False" in done.stdout
    name = done.stdout.split("unclosed ", 1)[1].split()[0]
    assert not os.path.exists("/dev/shm/" + name.lstrip("/"))
    assert "shared_memory" not in done.stderr, done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA stream memory operations")
def test_the_stream_waits_for_a_host_word_and_writes_one():
    from infer.cuda_driver import cuda_driver

    ops = cuda_driver()
    word = torch.zeros(2, dtype=torch.int64).pin_memory()
    address = ops.device_pointer(word.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    word[0] = 5
    ops.wait_at_least(stream, address, 5)
    ops.write(stream, address + 8, 7)
    torch.cuda.synchronize()
    assert word[1] == 7
    ops.wait_at_least(stream, address, 6)  # passes once the host writes 6
    ops.write(stream, address + 8, 9)
    time.sleep(0.2)
    assert word[1] == 7  # still waiting
    word[0] = 6
    torch.cuda.synchronize()
    assert word[1] == 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream waits of a CUDA device")
@pytest.mark.parametrize("workers", [1, 2])
def test_on_cuda_a_kernel_after_the_streams_wait_sees_that_steps_masks(workers):
    """The masks handed out on the device are that step's fill, not an earlier step's
    (the workers rewrite the same bytes of their block every step), with every row's
    worker's masks in: rows 1 and 2 are two workers' with two."""
    from infer.engine.grammar_process import GrammarProcess
    from infer.engine.structured_output import StructuredOutputs, apply_token_masks

    tokenizer = ours("smollm2")
    vocab = tokenizer.vocab_size
    library = StructuredOutputs(tokenizer, vocab)
    process = GrammarProcess(tokenizer, vocab, 4, torch.device("cuda"), workers=workers)
    try:
        grammar = library.compile(StructuredOutputsParams(json=SCHEMA))
        remote = [process.matcher(grammar), process.matcher(grammar)]  # ids 1 and 2
        local = library.matcher(grammar)  # both rows take the same tokens
        masked = [(1, remote[0]), (2, remote[1])]
        allowed_before = None
        for token in tokenizer.encode('{"name":"x","tags":["a"]}', add_special_tokens=False)[:6]:
            step, masks = process.masks(3, masked)
            assert masks.is_cuda
            logits = torch.zeros(3, vocab, device="cuda")
            apply_token_masks(logits, masks)
            expected = library.allocate_masks(3)
            library.fill_masks([local], expected, [1])
            expected[2] = expected[1]
            reference = torch.zeros(3, vocab)
            apply_token_bitmask_ref(reference, expected, torch.tensor([1, 2]))
            allowed = torch.isfinite(reference)
            assert torch.equal(torch.isfinite(logits).cpu(), allowed)
            assert allowed[0].all() and 0 < int(allowed[1].sum()) < vocab
            process.publish(step, torch.tensor([0, token, token], device="cuda"))
            assert process.verdicts(step, masked).refused == []
            assert local.accept(token)
            allowed_before = allowed if allowed_before is None else allowed_before
        assert not torch.equal(allowed, allowed_before)  # the masks changed on the way
    finally:
        process.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device waits, not the loop")
def test_on_cuda_fills_asked_for_ahead_of_a_paused_worker_are_taken_in_order():
    """The loop asks for more fills than the block has slots while the worker is stopped:
    it waits for a slot, the worker takes every fill in order (those never published are
    dropped), and the last step's masks and verdicts are right."""
    import signal

    from infer.engine.grammar_process import GrammarProcess
    from infer.engine.grammar_worker import FILL_SLOTS
    from infer.engine.structured_output import StructuredOutputs

    tokenizer = ours("smollm2")
    vocab = tokenizer.vocab_size
    library = StructuredOutputs(tokenizer, vocab)
    process = GrammarProcess(tokenizer, vocab, 2, torch.device("cuda"))
    try:
        grammar = library.compile(StructuredOutputsParams(regex=r"ab|cd"))
        remote, local = process.matcher(grammar), library.matcher(grammar)
        process.masks(2, [(0, remote)])  # the worker has made the matcher
        torch.cuda.synchronize()
        os.kill(process.processes[0].pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (process.processes[0].pid, signal.SIGCONT)).start()
        start = time.monotonic()
        for _ in range(FILL_SLOTS + 1):
            step, masks = process.masks(2, [(0, remote)])
        assert time.monotonic() - start > 0.3  # waited for the worker to take a fill
        expected = library.allocate_masks(2)
        library.fill_masks([local], expected, [0])
        expected[1] = -1  # a row no matcher names allows every token
        assert torch.equal(masks.cpu(), expected)
        token = tokenizer.encode("ab", add_special_tokens=False)[0]
        process.publish(step, torch.tensor([token, 0], device="cuda"))
        verdicts = process.verdicts(step, [(0, remote)])
        assert verdicts.refused == [] and verdicts.failed == []
    finally:
        process.close()


def test_steps_of_the_same_rows_fill_and_feed_as_each_matcher_asked_anew():
    """Steps of the same masked rows take the matchers the last feed left going (without
    asking each one again): every step's masks and verdicts are those of matchers kept
    beside the worker's, until a message comes, after which a dropped matcher's row
    allows every token again, as it did when each step asked."""
    import llguidance

    from infer.engine import grammar_worker
    from infer.engine.structured_output import StructuredOutputs, library_tokenizer_json

    tokenizer = ours("smollm2")
    vocab, words, rows = tokenizer.vocab_size, (tokenizer.vocab_size + 31) // 32, 70
    library = StructuredOutputs(tokenizer, vocab)
    grammar = library.compile(StructuredOutputsParams(regex=r"[a-z]{1,8}"))
    lib_tokenizer = llguidance.LLTokenizer(library_tokenizer_json(tokenizer), n_vocab=vocab,
                                           eos_token=list(tokenizer.eos_token_ids))
    layout = SharedLayout(memoryview(bytearray(SharedLayout.size(rows, words))), rows, words)
    reader, writer = multiprocessing.Pipe(duplex=False)
    worker = grammar_worker.Worker(layout, lib_tokenizer, llguidance.LLExecutor(), reader,
                                   False)
    ours_ = {m: library.matcher(grammar) for m in range(rows)}
    for m in range(rows):
        worker.matchers[m] = llguidance.LLMatcher(lib_tokenizer, grammar, log_level=0)
    ids = np.arange(rows)
    row_of = (ids * 17) % rows  # a matcher's row is not its id
    dropped = None
    for step in range(1, 6):
        if step == 4:  # the loop drops a matcher; the next fills must ask every matcher
            dropped = 3
            writer.send(("drop", [dropped]))
            assert worker.receive()
        slot = step % grammar_worker.FILL_SLOTS
        layout.requests[slot] = (rows, rows, step - 1)
        layout.request_ids[slot, :rows], layout.request_rows[slot, :rows] = ids, row_of
        layout.header[grammar_worker.TOKENS_STAMP] = step - 1
        if step == 3:  # the steps before fed every row, none finished: no matcher asked
            assert worker._live_pairs(ids, row_of) is worker.live[2]
        worker.fill(step)
        want = library.allocate_masks(rows)
        going = [(m, r) for m, r in zip(ids.tolist(), row_of.tolist())
                 if m != dropped and not ours_[m].terminated]
        want[[r for _, r in going]] = 0
        if going:
            library.fill_masks([ours_[m] for m, _ in going], want, [r for _, r in going])
        free = [r for r in range(rows) if r not in {r for _, r in going}]
        want[free] = -1
        assert np.array_equal(layout.masks[:rows], want.numpy()), step
        for m, r in zip(ids.tolist(), row_of.tolist()):  # the n-th allowed token, varied
            allowed = np.flatnonzero(np.unpackbits(
                layout.masks[r].view(np.uint8), bitorder="little")[:vocab])
            layout.tokens[r] = int(allowed[(m * 7 + step) % len(allowed)])
        layout.header[grammar_worker.TOKENS_STAMP] = step
        worker.feed(*worker.pending)
        for m, r in zip(ids.tolist(), row_of.tolist()):
            if m == dropped:
                assert layout.verdicts[step % 2][r] == TAKEN
                continue
            if ours_[m].terminated:
                assert layout.verdicts[step % 2][r] == STOPPED
                continue
            took = ours_[m].accept(int(layout.tokens[r]))
            want_verdict = (REFUSED if not took else STOPPED if ours_[m].terminated else TAKEN)
            assert layout.verdicts[step % 2][r] == want_verdict, (step, m)
