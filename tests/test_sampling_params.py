import dataclasses

import pytest

from infer.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    p = SamplingParams(temperature=1, top_p=1, min_p=0)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    # dataclasses.replace re-runs __post_init__ on already-normalised values
    q = dataclasses.replace(SamplingParams(stop="x", seed=1), seed=2)
    assert q.stop == ["x"] and q.seed == 2


@pytest.mark.parametrize("t, greedy", [(0, True), (0.0, True), (5e-6, True), (1e-5, False),
                                       (0.7, False), (2.0, False)])
def test_greedy(t, greedy):
    assert SamplingParams(temperature=t).greedy is greedy


def test_accepts_boundaries():
    SamplingParams(top_p=1e-9, min_p=1.0, top_k=1, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=1e-3, logprobs=0, min_tokens=5, max_tokens=5, seed=-3)
    SamplingParams(logprobs=20, min_tokens=100, max_tokens=None, n=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n must be at least 1"),
    ({"n": 1.5}, "n must be an int"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
    ({"top_p": None}, "top_p must be a number"),
    ({"top_k": -2}, "top_k must be -1 or 0"),
    ({"top_k": 2.0}, "top_k must be an int"),
    ({"min_p": -0.01}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": "10"}, "max_tokens must be an int or None"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"min_tokens": 17}, r"min_tokens \(17\) must not exceed max_tokens \(16\)"),
    ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids must be ints"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids must be ints"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop": ""}, "stop strings must not be empty"),
    ({"stop": ["a", ""]}, "stop strings must not be empty"),
    ({"stop": ["a", 3]}, "stop strings must be strings"),
    ({"stop": 3}, "stop must be a string or a list"),
    ({"stop": ["s"] * 33}, "stop has 33 strings; at most 32"),
    ({"stop": "x" * 129}, "at most 128 characters, got one of 129"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids has 257 ids; at most 256"),
    ({"seed": 1.5}, "seed must be an int or None"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
])
def test_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
