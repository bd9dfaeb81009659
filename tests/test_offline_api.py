"""The offline API as scripts copied from vLLM's docs call it: every prompt form, `LLM.chat`
with its keyword arguments and content parts, vLLM's `LLM(...)` arguments, and the
SamplingParams fields beyond sampling (prompt_logprobs, logit_bias, allowed_token_ids,
bad_words, detokenize, truncate_prompt_tokens), checked against transformers' logits of
the same weights where numbers are involved."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from engine_fixtures import hf_model, make_llm
from real_models import smollm2_gguf

from infer import SamplingParams
from infer.engine.outputs import RequestMetrics
from infer.engine.sampler import SamplingBatch, sample
from infer.llm_args import engine_config
from infer.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=6)
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if tools %}<tools:{{ tools | length }}>{% endif %}{% if shout %}!{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@cache
def llm():
    return make_llm(num_blocks=96, max_model_len=512)


def run(prompts, params=GREEDY):
    return llm().generate(prompts, params, use_tqdm=False)


@cache
def hf_log_softmax(ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' float64 log-softmax at every position of `ids` (row j: token j+1)."""
    with torch.no_grad():
        logits = hf_model(str(smollm2_gguf()))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def rank_of(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


# -- prompt forms and outputs -------------------------------------------------------
def test_every_prompt_form_gives_the_same_completion():
    ids = llm().get_tokenizer().encode(PROMPT)
    [want] = run(PROMPT)
    forms = [[PROMPT], ids, [ids], {"prompt": PROMPT}, {"prompt_token_ids": ids},
             {"prompt_token_ids": ids, "prompt": PROMPT}, [PROMPT, {"prompt_token_ids": ids}]]
    for form in forms:
        for out in run(form):
            assert out.prompt_token_ids == ids
            assert out.outputs[0].token_ids == want.outputs[0].token_ids, form
    assert want.prompt == PROMPT
    assert run(ids)[0].prompt is None  # token ids alone carry no text
    assert run({"prompt_token_ids": ids, "prompt": PROMPT})[0].prompt == PROMPT


def test_metrics_are_attributes_in_order():
    [out] = run(PROMPT)
    m = out.metrics
    assert isinstance(m, RequestMetrics)
    assert m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time
    assert m.time_to_first_token == m.first_token_time - m.arrival_time


# -- LLM.chat --------------------------------------------------------------------------
def test_chat_takes_content_parts_and_sets_the_prompt():
    tok = llm().get_tokenizer()
    plain = [{"role": "user", "content": "What is 2+2?\nAnswer briefly."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"},
                                          {"type": "text", "text": "Answer briefly."}]}]
    [a] = llm().chat(plain, GREEDY, use_tqdm=False)
    [b] = llm().chat(parts, GREEDY, use_tqdm=False)
    assert a.prompt == b.prompt == tok.apply_chat_template(plain, True)
    assert a.prompt_token_ids == b.prompt_token_ids == tok.encode_chat(plain)
    assert a.outputs[0].text == b.outputs[0].text
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*'image_url'"):
        llm().chat([{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "x"}}]}])


def test_chat_keyword_arguments_reach_the_template():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    convo = [{"role": "user", "content": "hi"}]
    [out] = llm().chat(convo, GREEDY, use_tqdm=False, chat_template=TEMPLATE, tools=tools,
                       chat_template_kwargs={"shout": True})
    assert out.prompt == "[user]hi<tools:1>![assistant]"
    [out] = llm().chat(convo, GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                       add_generation_prompt=False)
    assert out.prompt == "[user]hi"


def test_chat_continues_the_final_message():
    convo = [{"role": "user", "content": "Say hi"},
             {"role": "assistant", "content": "Hello! I am"}]
    [out] = llm().chat(convo, GREEDY, use_tqdm=False, continue_final_message=True,
                       add_generation_prompt=False)
    assert out.prompt.endswith("assistant\nHello! I am")
    # the continuation is what the model says after exactly that text
    [want] = run({"prompt_token_ids": out.prompt_token_ids})
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


# -- LLM(...) arguments -------------------------------------------------------------------
def test_vllm_constructor_arguments_map_or_are_refused_by_name():
    config = engine_config("m", {"enforce_eager": True, "trust_remote_code": True,
                                 "enable_prefix_caching": False, "tensor_parallel_size": 1,
                                 "max_num_seqs": 8})
    assert (config.cuda_graphs, config.prefix_caching, config.max_num_seqs) == (False, False, 8)
    assert engine_config("m", {"enforce_eager": False}).cuda_graphs
    with pytest.raises(ValueError, match="did you mean enforce_eager"):
        engine_config("m", {"enforce_eagr": True})
    assert engine_config("m", {"tensor_parallel_size": 2}).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        engine_config("m", {"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match="not both"):
        engine_config("m", {"enforce_eager": True, "cuda_graphs": True})


def test_vllm_speculative_config_maps_onto_the_speculative_fields():
    ngram = engine_config("m", {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}})
    assert (ngram.speculative_method, ngram.num_speculative_tokens, ngram.ngram_min,
            ngram.ngram_max) == ("ngram", 5, 2, 3)
    for spec in ({"model": "d.gguf"}, {"method": "draft_model", "model": "d.gguf"}):
        draft = engine_config("m", {"speculative_config": {**spec, "quantization": "int8"}})
        assert (draft.speculative_method, draft.draft_model, draft.draft_quantization) == \
            ("draft", "d.gguf", "int8")
    assert engine_config("m", {"speculative_config": None}).speculative_method == "none"
    for spec, message in [
            ({"method": "eagle", "model": "e"}, "method 'eagle' is not supported"),
            ({"num_speculative_tokens": 3}, "method None is not supported"),
            ({"method": "ngram", "model": "d"}, "key 'model' is not supported with method"),
            ({"model": "d", "prompt_lookup_max": 3}, "key 'prompt_lookup_max' is not"),
            ({"method": "ngram", "disable_by_batch_size": 4}, "'disable_by_batch_size'"),
            ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            engine_config("m", {"speculative_config": spec})
    with pytest.raises(ValueError, match="give speculative_config or num_speculative_tokens"):
        engine_config("m", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                            "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="give speculative_config or speculative_method"):
        engine_config("m", {"speculative_method": "self", "speculative_config": {"model": "d"}})
    # a field the dict does not set may come beside it
    assert engine_config("m", {"speculative_config": {"method": "ngram"},
                               "num_speculative_tokens": 2}).num_speculative_tokens == 2


# -- SamplingParams fields -------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
    ({"logit_bias": {5: 101}}, "logit_bias values must be in"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids must be >= 0"),
    ({"bad_words": "word"}, "bad_words must be a list"),
    ({"bad_words": [" "]}, "bad_words must be non-empty"),
    ({"detokenize": False, "stop": ["x"]}, "stop strings need the text"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be at least 1"),
])
def test_new_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused_by_field():
    vocab = llm().engine.input_processor.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [vocab])):
        with pytest.raises(ValueError, match=f"{field} out of range"):
            run(PROMPT, SamplingParams(**{field: value}))


def test_prompt_logprobs_match_transformers_across_chunks_and_cache():
    """Chunked prefill (chunks of 4), a second identical prompt that must not take prefix
    cache hits, n=2 (one list per request): every entry equals transformers' float64
    log-softmax, ranks included."""
    chunked = make_llm(num_blocks=96, max_model_len=512, prefill_chunk_size=4)
    text = PROMPT + " Paris, and the capital of Germany is"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    outs = chunked.generate([text, text], params, use_tqdm=False)
    ids = outs[0].prompt_token_ids
    ref = hf_log_softmax(tuple(ids))
    for out in outs:
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for j in range(1, len(ids)):
            row = ref[j - 1]
            entry = entries[j]
            assert entry[ids[j]].logprob == pytest.approx(row[ids[j]].item(), abs=1e-4)
            assert entry[ids[j]].rank == rank_of(row, ids[j])
            top = row.topk(3).indices.tolist()
            assert set(entry) == {ids[j], *top}
            for t in top:
                assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
    assert outs[1].num_cached_tokens == 0  # computed again, not served from the cache


def test_prompt_logprobs_come_once_in_delta_outputs():
    engine = llm().engine
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta-plp", PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [out.prompt_logprobs for out in engine.step()]
    assert seen[0] is not None and len(seen[0]) == len(engine.tokenizer.encode(PROMPT))
    assert all(p is None for p in seen[1:])
    assert all(len(e) == 1 for e in seen[0][1:])  # 0: the prompt token's own entry only


def test_sampled_token_has_its_rank_even_outside_the_top_n():
    params = SamplingParams(temperature=1.5, max_tokens=8, seed=7, logprobs=1,
                            ignore_eos=True)
    [out] = run(PROMPT, params)
    completion = out.outputs[0]
    ref = hf_log_softmax(tuple(out.prompt_token_ids + completion.token_ids[:-1]))
    base = len(out.prompt_token_ids) - 1
    ranks = []
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        ranks.append(entry[token].rank)
        assert entry[token].rank == rank_of(ref[base + i], token)
    assert max(ranks) > 1, "a hot sampler should leave the top-1 at least once"


def test_logit_bias_forces_or_bans_a_token():
    ids = llm().get_tokenizer().encode(PROMPT)
    first = hf_log_softmax(tuple(ids))[-1]
    greedy = int(first.argmax())
    [banned] = run(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                           logit_bias={greedy: -100}))
    runner_up = int(first.topk(2).indices[1])
    assert banned.outputs[0].token_ids == [runner_up]
    forced = int(first.argmin())
    [out] = run(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                       logit_bias={forced: 100}))
    assert out.outputs[0].token_ids == [forced] * 4


def test_allowed_token_ids_restrict_sampling():
    ids = llm().get_tokenizer().encode(PROMPT)
    first = hf_log_softmax(tuple(ids))[-1]
    allowed = first.argsort()[:5].tolist()  # the five least likely tokens
    [greedy] = run(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                          allowed_token_ids=allowed))
    assert greedy.outputs[0].token_ids == [max(allowed, key=lambda t: first[t].item())]
    [out] = run(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                       allowed_token_ids=allowed, ignore_eos=True))
    assert set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated():
    [plain] = run(PROMPT)
    assert "Paris" in plain.outputs[0].text  # what the ban must change
    [out] = run(PROMPT, SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"]))
    assert "Paris" not in out.outputs[0].text


def test_a_bad_word_of_several_tokens_bans_its_last_token_after_the_others():
    v = 10
    params = [SamplingParams(bad_words_token_ids=[[3, 4, 5]]),
              SamplingParams(bad_words_token_ids=[[3, 4, 5], [7]])]
    logits = torch.zeros(2, v)
    logits[:, 5] = 10.0  # the greedy choice, unless banned
    logits[:, 7] = 5.0
    greedy = [SamplingParams(temperature=0, bad_words_token_ids=p.bad_words_token_ids)
              for p in params]
    batch = SamplingBatch.build(greedy, [[1], [1]], [[3, 4], [4, 3]], v, "cpu")
    # row 0 ends in [3, 4]: 5 is banned; row 1 ends in [4, 3]: 5 is allowed, 7 always banned
    assert batch.banned[0].nonzero().flatten().tolist() == [5]
    assert batch.banned[1].nonzero().flatten().tolist() == [7]
    assert sample(logits, batch).token_ids.tolist() == [7, 5]


def test_detokenize_false_gives_token_ids_only():
    [want] = run(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=1))
    [out] = run(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=1,
                                       detokenize=False))
    completion = out.outputs[0]
    assert completion.text == "" and completion.token_ids == want.outputs[0].token_ids
    assert all(lp.decoded_token is None for entry in completion.logprobs
               for lp in entry.values())


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    ids = llm().get_tokenizer().encode(PROMPT)
    [out] = run(PROMPT, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3))
    assert out.prompt_token_ids == ids[-3:]
    [want] = run({"prompt_token_ids": ids[-3:]}, SamplingParams(temperature=0, max_tokens=4))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
