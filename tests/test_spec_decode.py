"""Speculative decoding in the engine, each method (n-gram drafts, the model's own first
layers, a draft model): greedy output identical to decoding without drafts on the real
SmolLM2 (alone, in mixed batches, with chunked prefill and prefix hits; with penalties,
logprobs, grammars and steps launched ahead through the n-gram and draft-model methods),
seeded sampling batch-invariant, and no KV block leaked whatever is added, stepped and
aborted."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from real_models import gemma3_gguf
from tiny_model import tiny_model_dir

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.loader.default_model import default_model_path
from infer.models.linear import LinearBase
from infer.sampling_params import StructuredOutputsParams

LIST = "apple, banana, cherry, date, elderberry, fig, grape"
PROMPTS = [
    f"Repeat this list exactly: {LIST}. Again: {LIST}. Again:",
    "Write the numbers from one to twenty in words, separated by commas:",
    f"Copy: {LIST}. Copy:",
    "The capital of France is",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)
# float32 weights: the kept-quantized default computes its logits through bfloat16 (steps
# of 1/8 at their size), where a step over several positions may round a near-tie the
# other way than one over one position; in float32 the text must be the same.
SMALL = dict(device="cpu", max_model_len=512, num_blocks=256, prefill_chunk_size=24,
             quantization="none")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**SMALL)


METHODS = {
    "ngram": dict(speculative_method="ngram"),
    # 10 of 30 layers accept few drafts: k = 2 keeps the CPU time of the many steps down
    "self": dict(speculative_method="self", self_draft_layers=10, num_speculative_tokens=2),
    # The model as its own draft (in float32 as the model): every draft should be
    # accepted (see below).
    "draft": dict(speculative_method="draft", draft_quantization="none"),
}


@pytest.fixture(scope="module")
def spec_engines() -> dict[str, LLM]:
    """The engines of this module, one per method, built when first asked for."""
    return {}


def _spec(engines: dict[str, LLM], method: str) -> LLM:
    if method not in engines:
        flags = {"num_speculative_tokens": 4, **METHODS[method]}
        if method == "draft":
            flags["draft_model"] = str(default_model_path())
        engines[method] = LLM(**SMALL, **flags)
    return engines[method]


@pytest.fixture(scope="module", params=list(METHODS))
def spec(request, spec_engines) -> LLM:
    return _spec(spec_engines, request.param)


# What happens to the drafts once proposed (penalties, stops, logprobs, grammars, steps
# launched ahead) is the same code for every method; the self drafts' many short steps
# would add minutes of CPU time, not coverage, so those tests take the other two.
@pytest.fixture(scope="module", params=["ngram", "draft"])
def verifying_spec(request, spec_engines) -> LLM:
    return _spec(spec_engines, request.param)


_GENERATED: dict = {}


def generate_once(llm: LLM, prompts, params) -> list:
    """`llm.generate`, remembered: the reference engines give the same outputs for the
    same request every time, and every method's test asks for them."""
    key = (id(llm), repr(prompts), repr(params))
    if key not in _GENERATED:
        _GENERATED[key] = llm.generate(prompts, params, use_tqdm=False)
    return _GENERATED[key]


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def reference_tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in generate_once(llm, prompts, params)]


def assert_same_greedy(plain: LLM, prompts: list[str], want: list[list[int]],
                       got: list[list[int]]) -> None:
    """Identical, or they part where the model's two best tokens tie to float32 noise (a
    verify step computes several positions at once, in another order of sums)."""
    for prompt, w, g in zip(prompts, want, got):
        if w == g:
            continue
        at = next(i for i, (a, b) in enumerate(zip(w, g)) if a != b)
        [out] = plain.generate({"prompt_token_ids": plain.get_tokenizer().encode(prompt)
                                + w[:at]}, SamplingParams(max_tokens=1, temperature=0,
                                                          logprobs=5), use_tqdm=False)
        top = out.outputs[0].logprobs[0]
        assert w[at] in top and g[at] in top, (prompt, at, top)
        assert abs(top[w[at]].logprob - top[g[at]].logprob) < 1e-4, (prompt, at, top)


def test_greedy_tokens_are_those_without_drafts(plain, spec):
    """Each prompt alone, then all together (a prefix hit for the repeated list prompt,
    prompts longer than the 24-token prefill chunk)."""
    core = spec.engine.core
    want = reference_tokens(plain, PROMPTS, GREEDY)
    drafted = core.num_draft_tokens
    assert_same_greedy(plain, PROMPTS, want, [tokens(spec, [p], GREEDY)[0] for p in PROMPTS])
    assert_same_greedy(plain, PROMPTS + PROMPTS[:1], want + want[:1],
                       tokens(spec, PROMPTS + PROMPTS[:1], GREEDY))
    assert core.num_draft_tokens > drafted and core.num_accepted_tokens > 0
    assert spec.engine.stats()["kv_blocks_used"] == 0


def test_a_draft_models_drafts_stay_on_the_device_unless_the_host_needs_them(
        plain, spec_engines, monkeypatch):
    """A model's drafts are never read back when no sequence needs their values (the step
    verifying them is queued behind the round): greedy tokens the plain engine's with
    `propose` (the host's way) refusing to run; with a penalty, which counts the drafts,
    the host's way and never the device's."""
    from infer.spec.model_drafter import ModelDrafter

    spec = _spec(spec_engines, "draft")
    core = spec.engine.core
    want = reference_tokens(plain, PROMPTS[:2], GREEDY)

    def refuse(self, requests):
        raise AssertionError(f"{self.__class__.__name__}.propose ran")

    with monkeypatch.context() as patch:
        patch.setattr(ModelDrafter, "propose", refuse)
        drafted = core.num_draft_tokens
        assert_same_greedy(plain, PROMPTS[:2], want, tokens(spec, PROMPTS[:2], GREEDY))
        assert core.num_draft_tokens > drafted and not core._device_drafts
    penalized = SamplingParams(max_tokens=24, temperature=0, frequency_penalty=0.5)
    want = reference_tokens(plain, PROMPTS[:1], penalized)
    with monkeypatch.context() as patch:
        patch.setattr(ModelDrafter, "propose_on_device", refuse)
        drafted = core.num_draft_tokens
        assert_same_greedy(plain, PROMPTS[:1], want, tokens(spec, PROMPTS[:1], penalized))
        assert core.num_draft_tokens > drafted
        # and every time with `speculative_drafts_on_device` off
        patch.setattr(core, "config", dataclasses.replace(
            core.config, speculative_drafts_on_device=False))
        want = reference_tokens(plain, PROMPTS[1:2], GREEDY)
        drafted = core.num_draft_tokens
        assert_same_greedy(plain, PROMPTS[1:2], want, tokens(spec, PROMPTS[1:2], GREEDY))
        assert core.num_draft_tokens > drafted
    assert spec.engine.stats()["kv_blocks_used"] == 0


def test_greedy_rows_are_unchanged_beside_sampled_ones(plain, spec):
    want = reference_tokens(plain, PROMPTS[:2], GREEDY)
    mixed = [GREEDY, SamplingParams(max_tokens=24, temperature=0.9, seed=1),
             SamplingParams(max_tokens=24, temperature=1.0, top_p=0.8, n=2), GREEDY]
    outs = spec.generate(PROMPTS[:2] * 2, mixed, use_tqdm=False)
    assert_same_greedy(plain, PROMPTS[:2], want,
                       [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids])
    assert all(0 < len(c.token_ids) <= 24 and c.finish_reason in ("stop", "length")
               for o in outs for c in o.outputs)
    assert spec.engine.stats()["kv_blocks_used"] == 0


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(spec):
    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
    alone = tokens(spec, [PROMPTS[0]], seeded)[0]
    others = SamplingParams(max_tokens=32, temperature=1.0)
    together = spec.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [others, seeded, others],
                             use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone


def drafting(spec: LLM, run) -> tuple[int, int]:
    """The drafts judged and accepted while `run()` ran."""
    core = spec.engine.core
    before = core.num_draft_tokens, core.num_accepted_tokens
    run()
    return core.num_draft_tokens - before[0], core.num_accepted_tokens - before[1]


REPEATS = ["Say 'ha' thirty times: ha ha ha ha ha ha ha ha ha ha",
           "Count: 1 1 1 1 1 1 1 1 1 1 1 1"]


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=0.3),
                                       dict(repetition_penalty=1.1, presence_penalty=0.2)])
def test_penalties_count_the_drafts_before_each_position(plain, verifying_spec, penalties):
    """A drafted position is penalised for the drafts before it (on prompts that repeat
    one token, the frequency penalty ends the repeats a draft or two later without that);
    greedy text as without drafts (which the penalties change)."""
    spec = verifying_spec
    params = SamplingParams(max_tokens=30, temperature=0, **penalties)
    want = reference_tokens(plain, REPEATS, params)
    got: list = []
    drafted, _ = drafting(spec, lambda: got.extend(tokens(spec, REPEATS, params)))
    assert drafted > 0
    assert_same_greedy(plain, REPEATS, want, got)
    assert want != reference_tokens(plain, REPEATS, GREEDY)


def test_a_stop_string_inside_a_verified_run_ends_the_text_there(plain, verifying_spec):
    """Several tokens accepted in one step: the text ends at the stop string among them,
    the tokens after it are not returned."""
    spec = verifying_spec
    params = SamplingParams(max_tokens=40, temperature=0, stop=["date"])
    want = generate_once(plain, PROMPTS[:1], params)[0].outputs[0]
    got: list = []
    _, accepted = drafting(spec, lambda: got.extend(spec.generate(PROMPTS[:1], params,
                                                                  use_tqdm=False)))
    got = got[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", "date")
    assert accepted > 0


def test_logprobs_of_verified_tokens_are_those_without_drafts(plain, verifying_spec):
    """Raw logprobs (and the top 3) of every token, drafted or not, as the model gives
    them one token at a time."""
    spec = verifying_spec
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    want = generate_once(plain, PROMPTS[:2], params)
    got: list = []
    _, accepted = drafting(spec, lambda: got.extend(spec.generate(PROMPTS[:2], params,
                                                                  use_tqdm=False)))
    assert accepted > 0
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for token, lw, lg in zip(g.token_ids, w.logprobs, g.logprobs):
            assert set(lg) == set(lw) and token in lg
            for t in lw:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)
                assert lg[t].rank == lw[t].rank


def test_sampled_rows_report_the_logprob_of_each_token_they_keep(spec):
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=3, logprobs=0)
    [out] = spec.generate(PROMPTS[:1], params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    assert all(list(lp) == [t] and lp[t].logprob <= 0 for t, lp in zip(c.token_ids, c.logprobs))


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex=r"[a-z]+(, [a-z]+){3,12}"),  # copies, then must stop
    StructuredOutputsParams(choice=["apple, banana, cherry", "fig, grape"]),
])
def test_grammars_mask_every_drafted_position(plain, verifying_spec, constraint):
    """The list prompt's drafts copy from the prompt, then run into what the grammar
    refuses (a period; more items than it allows): cut when proposed, masks at every
    verified position; the greedy text is the plain constrained text."""
    spec = verifying_spec
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=constraint)
    want = reference_tokens(plain, PROMPTS[:1], params)
    got: list = []
    drafted, accepted = drafting(spec, lambda: got.extend(tokens(spec, PROMPTS[:1], params)))
    assert drafted > 0 and accepted > 0
    assert_same_greedy(plain, PROMPTS[:1], want, got)
    text = plain.get_tokenizer().decode(got[0])
    assert re.fullmatch(constraint.regex or "apple, banana, cherry|fig, grape", text), text
    assert spec.engine.stats()["kv_blocks_used"] == 0


def test_steps_above_the_speculation_batch_are_launched_ahead(plain, verifying_spec):
    """Async scheduling composes: with speculative_max_batch = 2, the steps of four
    sequences are launched ahead, those of the last two draft; text as without drafts."""
    spec = verifying_spec
    core = spec.engine.core
    config, core.config = core.config, dataclasses.replace(core.config,
                                                           speculative_max_batch=2)
    try:
        params = [SamplingParams(max_tokens=n, temperature=0) for n in (8, 12, 40, 40)]
        want = [o.outputs[0].token_ids for o in generate_once(plain, PROMPTS, params)]
        ahead = core.num_steps_launched_ahead
        got: list = []
        drafted, _ = drafting(spec, lambda: got.extend(
            o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)))
    finally:
        core.config = config
    assert core.num_steps_launched_ahead > ahead and drafted > 0
    assert_same_greedy(plain, PROMPTS, want, got)
    assert spec.engine.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def gemma() -> LLM:
    return LLM(str(gemma3_gguf()), **SMALL)


@pytest.mark.parametrize("method", ["self", "draft"])
def test_gemma3_greedy_tokens_are_those_without_drafts(gemma, method):
    """Gemma 3 (sliding-window and global layers, soft-capped logits) verifying drafts,
    which `self` makes from half its 18 layers and `draft` with Gemma 3 itself as the draft
    model (n-gram drafts go through the same verify step: each case costs 30 s of CI)."""
    flags = {"self": dict(speculative_method="self"),
             "draft": dict(speculative_method="draft", draft_model=str(gemma3_gguf()))}
    prompts = PROMPTS[:1]  # the one that drafts most; Gemma's 262k-token head is slow
    params = SamplingParams(max_tokens=20, temperature=0)
    want = reference_tokens(gemma, prompts, params)
    spec = LLM(str(gemma3_gguf()), **SMALL, **flags[method])
    assert_same_greedy(gemma, prompts, want, tokens(spec, prompts, params))
    assert spec.engine.core.num_draft_tokens > 0
    assert spec.engine.stats()["kv_blocks_used"] == 0


def test_the_model_as_its_own_draft_has_every_draft_accepted(spec):
    """A draft model whose cache follows every step of the target's, proposing from the
    right positions, is the target: only float32 near-ties between its one-token forwards
    and the verify's multi-token one can reject a draft."""
    core = spec.engine.core
    if core.config.speculative_method != "draft":
        pytest.skip("the draft model is the model only in the 'draft' case")
    before = core.num_draft_tokens, core.num_accepted_tokens
    tokens(spec, PROMPTS, GREEDY)
    drafted = core.num_draft_tokens - before[0]
    accepted = core.num_accepted_tokens - before[1]
    assert drafted > 50 and accepted >= 0.97 * drafted, (accepted, drafted)


def test_bad_speculative_settings_are_refused():
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(speculative_method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="draft_model goes with"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="draft_model goes with"):
        EngineConfig(speculative_method="ngram", draft_model="x")
    with pytest.raises(ValueError, match="self_draft_layers is set"):
        EngineConfig(self_draft_layers=2)
    with pytest.raises(ValueError, match="draft_quantization='int8' is set but there is no"):
        EngineConfig(speculative_method="ngram", draft_quantization="int8")
    with pytest.raises(ValueError, match="draft_quantization must be one of"):
        EngineConfig(speculative_method="draft", draft_model="x", draft_quantization="q4")
    with pytest.raises(ValueError, match=r"self_draft_layers must be in 1\.\.1"):
        LLMEngine(model=str(tiny_model_dir()), device="cpu", num_blocks=8,
                  speculative_method="self", self_draft_layers=2)


def test_a_draft_model_in_int8_drafts_for_the_float_model():
    """draft_quantization: the draft's layers in INT8 made at load, the output still the
    float model's own; the drafts are the model's but for INT8's rounding, so most land."""
    flags = dict(device="cpu", dtype="float32", num_blocks=96, block_size=4,
                 max_model_len=96)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9] * 6, [5, 6, 5, 6] * 7)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in LLM(str(TINY), **flags).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(TINY), **flags, speculative_method="draft", draft_model=str(TINY),
              draft_quantization="int8", num_speculative_tokens=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    draft = llm.engine.core.drafter.runner.model
    assert {m.quant_method.format for m in draft.modules() if isinstance(m, LinearBase)} \
        == {"int8"}
    target = llm.engine.core.runner.model
    assert {m.quant_method.format for m in target.modules() if isinstance(m, LinearBase)} \
        == {"none"}
    stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] >= 0.5 * stats["spec_draft_tokens"] > 0


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="another vocabulary than the model"):
        LLMEngine(model=str(tiny_model_dir()), device="cpu", num_blocks=8,
                  speculative_method="draft", draft_model=str(default_model_path()))


TINY = tiny_model_dir()
TINY_METHODS = {"ngram": dict(speculative_method="ngram"),
                "self": dict(speculative_method="self", self_draft_layers=1),
                "draft": dict(speculative_method="draft", draft_model=str(TINY))}


def tiny_engine(method: str, **flags) -> LLMEngine:
    return LLMEngine(model=str(TINY), device="cpu", num_blocks=24, block_size=4,
                     max_model_len=96, num_speculative_tokens=3, max_num_batched_tokens=40,
                     speculative_max_batch=3, **TINY_METHODS[method], **flags)


@pytest.fixture(scope="module", params=list(TINY_METHODS))
def tiny(request) -> LLMEngine:
    return tiny_engine(request.param)


@pytest.fixture(scope="module")
def tiny_ahead() -> LLMEngine:
    """A draft model whose rounds are queued behind their verify steps, through its static
    buffers run eagerly (Triton attention, in the interpreter on a CPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU run compiles kernels for the GPU
        pytest.skip("a CPU engine with Triton attention runs in the interpreter only")
    engine = tiny_engine("draft", attention_backend="triton")
    engine.core.drafter.enable_graphs(3, 96, capture=False, ahead_batch=3)
    return engine


DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")  # cuda: with graphs


def test_tiny_tokens_and_logprobs_with_steps_launched_ahead():
    """Each method on INFER_TEST_DEVICE (on a GPU: decode, verify and draft graphs), four
    sequences with speculative_max_batch = 2: steps launched ahead while more than two
    run (a draft model's cache follows them from the ids on the device), drafts after;
    greedy tokens and logprobs as without drafts."""
    prompts = [[5, 6, 7, 8, 9] * 6, [5, 6, 5, 6] * 7, [7, 8, 9] * 5, [9, 5] * 8]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
              for n in (10, 16, 40, 40)]
    flags = dict(device=DEVICE, dtype="float32", num_blocks=96, block_size=4,
                 max_model_len=96, num_speculative_tokens=3)
    want = LLM(str(TINY), **flags).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    methods = list(TINY_METHODS.values())
    if DEVICE != "cpu":  # verify graphs whose attention walks whole sequences (no graphs
        # on a CPU), and rounds planned after the verdict is read
        methods.append({**TINY_METHODS["draft"], "verify_decode_attention": False,
                        "speculative_round_ahead": False})
    for method in methods:
        llm = LLM(str(TINY), **flags, speculative_max_batch=2, **method)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False)
        for w, g in zip(want, got):
            w, g = w.outputs[0], g.outputs[0]
            assert g.token_ids == w.token_ids, method
            for token, lw, lg in zip(g.token_ids, w.logprobs, g.logprobs):
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
        stats = llm.engine.stats()
        assert stats["num_steps_launched_ahead"] > 0 and stats["spec_draft_tokens"] > 0
        assert stats["kv_blocks_used"] == 0
        if "draft_model" in method:  # the model itself: its cache must have followed
            assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"]


def noisy_copy(model: Path, into: Path, scale: float) -> Path:
    """`model` with Gaussian noise of `scale` times each weight's spread added: a draft
    whose proposals the model accepts some of the time."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, into)
    torch.manual_seed(1)
    for file in into.glob("*.safetensors"):
        weights = load_file(file)
        save_file({name: w + scale * w.std() * torch.randn_like(w) if w.numel() > 1 else w
                   for name, w in weights.items()}, file, metadata={"format": "pt"})
    return into


def test_rounds_queued_behind_their_verify_steps_draft_as_the_host_would(tmp_path):
    """`speculative_round_ahead`: a round queued behind the step verifying the last one,
    its inputs taken from that step's verdict on the device (on INFER_TEST_DEVICE; on a
    CPU through the draft runner's static buffers run eagerly). A draft model (the tiny
    model with noise on its weights: verdicts from none to all accepted) and a
    self-draft: greedy tokens and logprobs those without drafts; the draft model's
    drafts those of the host's rounds (as many judged and accepted at each position); no
    block kept."""
    prompts = [[5, 6, 7, 8, 9] * 3, [5, 6, 5, 6] * 4, [7, 8, 9] * 4]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
              for n in (12, 24, 24)]
    flags = dict(device=DEVICE, dtype="float32", num_blocks=96, block_size=4,
                 max_model_len=96, num_speculative_tokens=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    want = LLM(str(TINY), **flags).generate(requests, params, use_tqdm=False)
    draft = dict(speculative_method="draft", draft_model=str(
        noisy_copy(TINY, tmp_path / "draft", 0.1)))
    stats = {}
    for name, method, ahead in (("host", draft, False), ("ahead", draft, True),
                                ("self", dict(speculative_method="self",
                                              self_draft_layers=1), True)):
        llm = LLM(str(TINY), **flags, **method, attention_backend="triton",
                  speculative_round_ahead=ahead)
        drafter = llm.engine.core.drafter
        if DEVICE == "cpu":  # (elsewhere the engine captured them)
            drafter.enable_graphs(4, 96, capture=False, logits=True,
                                  ahead_batch=4 if ahead else 0)
        got = llm.generate(requests, params, use_tqdm=False)
        for w, g in zip(want, got):
            w, g = w.outputs[0], g.outputs[0]
            assert g.token_ids == w.token_ids, name
            for token, lw, lg in zip(g.token_ids, w.logprobs, g.logprobs):
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
        assert (drafter.num_rounds_ahead > 0) == ahead
        stats[name] = llm.engine.stats()
        assert stats[name]["kv_blocks_used"] == 0
        assert 0 < stats[name]["spec_accepted_tokens"] < stats[name]["spec_draft_tokens"]
    at = [f"spec_{kind}_tokens_at_{i}" for kind in ("draft", "accepted") for i in range(3)]
    for key in ("spec_verified_rows", *at):
        assert stats["ahead"][key] == stats["host"][key], key
    # verdicts of every kind: none accepted, all three (the draft's cache behind)
    ahead = stats["ahead"]
    assert ahead[at[3]] < ahead["spec_verified_rows"] and ahead[at[5]] > 0


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(5, 9), min_size=1, max_size=30),
              st.integers(1, 24), st.booleans()),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 9)),
), max_size=25)
# Five sequences that outgrow the 24 blocks (preemption), one aborted, one added after.
PREEMPTING = ([("add", [5, 6, 7, 8, 9] * 6, 12, i % 2 == 1) for i in range(5)]
              + [("step", 3), ("abort", 1), ("add", [5, 6, 5, 6] * 7, 20, False),
                 ("step", 2)])
SLOW_FIXTURES = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


# Derandomized: the test after this one checks what these examples exercised.
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=SLOW_FIXTURES)
@given(actions=ACTIONS)
@example(actions=PREEMPTING)
def test_no_kv_block_leaks_whatever_is_added_stepped_and_aborted(tiny, actions):
    """Prompts over a 5-token alphabet repeat themselves: drafts are proposed, some
    accepted, some rejected (random weights); sequences are preempted when the 24
    blocks run out; steps of more than 3 sequences are launched ahead, without drafts."""
    run_actions(tiny, actions)


# Fewer examples: every step runs the interpreter's attention.
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=SLOW_FIXTURES)
@given(actions=ACTIONS)
@example(actions=PREEMPTING)
def test_no_kv_block_leaks_with_rounds_queued_ahead(tiny_ahead, actions):
    """The same with the draft model's rounds queued behind their verify steps: the
    slots a round holds past its verdict go back with the sequence, whatever ends it."""
    run_actions(tiny_ahead, actions)


def test_the_rounds_ahead_property_test_queued_rounds_ahead(tiny_ahead):
    """Runs after it: rounds were queued ahead, sequences preempted."""
    stats = tiny_ahead.stats()
    assert tiny_ahead.core.drafter.num_rounds_ahead > 0 and stats["num_preemptions"] > 0


def run_actions(engine: LLMEngine, actions: list) -> None:
    """Add, step and abort as `actions` say, step to the end: no KV block left in use."""
    added = []
    for action in actions:
        if action[0] == "add":
            _, prompt, max_tokens, sampled = action
            rid = f"r{len(added)}-{id(actions)}"
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                    temperature=1.0 if sampled else 0)
            engine.add_request(rid, prompt, params)
            added.append(rid)
        elif action[0] == "step":
            for _ in range(action[1]):
                engine.step()
        elif added:
            engine.abort_request(added[action[1] % len(added)])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


def test_the_property_test_exercised_drafts_and_preemption(tiny):
    """Runs after the property test (same module engine): its sequences did draft, had
    drafts rejected, ran out of blocks at times, and had steps launched ahead."""
    stats = tiny.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["num_preemptions"] > 0 and stats["num_steps_launched_ahead"] > 0
    drafts = [stats[f"spec_draft_tokens_at_{i}"] for i in range(3)]
    accepted = [stats[f"spec_accepted_tokens_at_{i}"] for i in range(3)]
    assert sum(drafts) == stats["spec_draft_tokens"]
    assert sum(accepted) == stats["spec_accepted_tokens"]
    assert drafts[0] == stats["spec_verified_rows"]  # every judged row had a first draft
    # a draft is accepted only after every draft before it
    assert all(a >= b for a, b in itertools.pairwise(accepted))
    assert all(a <= d for a, d in zip(accepted, drafts))


def test_a_draft_model_takes_the_gemv_with_triton_kernels(monkeypatch):
    """With Triton kernels (the interpreter here) the draft model's one-row matmuls go to
    infer's GEMV as the model's do; the tokens stay the model's own."""
    import infer.kernels.gemv as gemv

    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU run compiles kernels for the GPU
        pytest.skip("a CPU engine with Triton kernels runs in the interpreter only")

    flags = dict(device="cpu", dtype="float32", num_blocks=48, block_size=4,
                 max_model_len=64, attention_backend="triton", kernel_backend="triton")
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 4}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(str(TINY), **flags).generate(prompt, params, use_tqdm=False)
    llm = LLM(str(TINY), **flags, speculative_method="draft", draft_model=str(TINY),
              num_speculative_tokens=2)
    draft = llm.engine.core.drafter.runner.model
    weights = {m.weight.data_ptr() for m in draft.modules() if isinstance(m, LinearBase)}
    seen = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w, *a, **kw: seen.append(w.data_ptr()) or
                        real(x, w, *a, **kw))
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert weights & set(seen)
