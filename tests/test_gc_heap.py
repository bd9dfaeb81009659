"""The garbage collector and an engine's process: a process that serves one engine freezes
what it loaded (a full collection no longer walks it), which is safe only while an engine
let go is freed by reference counting alone; an offline engine does not freeze; and the
grammar library is used without the module that would add tens of thousands of objects to
every later collection."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
from tiny_model import tiny_model_dir

from infer import LLM, SamplingParams, StructuredOutputsParams


def test_an_offline_engine_leaves_the_collector_alone():
    """Only a process that serves one engine for its life freezes its heap (the core's, the
    server's): an offline `LLM` does not, since a process may build and drop many and a
    frozen cycle is never collected."""
    before = gc.get_freeze_count()
    llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=32, block_size=8)
    assert gc.get_freeze_count() == before
    assert any(o is llm.engine.kv for o in gc.get_objects())


def test_freezing_leaves_what_was_loaded_out_of_collections():
    from infer.engine.setup import freeze_startup_objects

    llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=32, block_size=8)
    model, kv = llm.engine.model, llm.engine.kv
    freeze_startup_objects()
    try:
        walked = gc.get_objects()  # every generation a collection walks; frozen ones not
        assert not any(o is model or o is kv for o in walked)
    finally:
        gc.unfreeze()


def test_an_engine_let_go_is_freed_by_reference_counting_alone():
    llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=32, block_size=8)
    regex = StructuredOutputsParams(regex="[a-z]+")
    pytest.importorskip("llguidance")
    outs = llm.generate(["hello", "hi"], [SamplingParams(max_tokens=4, ignore_eos=True),
                                          SamplingParams(max_tokens=4, structured_outputs=regex)],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    engine = llm.engine
    parts = {"llm": llm, "engine": engine, "core": engine.core, "model": engine.model,
             "kv": engine.kv, "scheduler": engine.scheduler}
    refs = {name: weakref.ref(part) for name, part in parts.items()}
    gc.disable()  # reference counting alone from here: a cycle stays, as in a frozen heap
    try:
        del llm, engine, parts, outs
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_masks_are_filled_without_llguidance_torch():
    pytest.importorskip("llguidance")
    code = """
import sys
from reference_tokenizers import ours
from infer.engine.structured_output import StructuredOutputs
from infer.sampling_params import StructuredOutputsParams
tok = ours("smollm2")
so = StructuredOutputs(tok, tok.vocab_size)
matcher = so.matcher(so.compile(StructuredOutputsParams(regex="[0-9]+")))
masks = so.allocate_masks(2)
so.fill_masks([matcher], masks, [1])
allowed = [t for t in range(tok.vocab_size) if masks[1, t // 32] >> (t % 32) & 1]
assert allowed and all(tok.decode([t]).isdigit() for t in allowed), allowed[:10]
assert not masks[0].any()
print(sorted(m for m in ("llguidance.torch", "sympy") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=__file__.rsplit("/", 1)[0], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
