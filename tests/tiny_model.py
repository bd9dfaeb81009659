"""Test helper: a tiny random Llama written to a directory (safetensors, a small BPE
tokenizer, a chat template), which `--model` and `LLM(...)` accept; no server needed."""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_TINY_CORPUS = ("The quick brown fox jumps over the lazy dog. What is 2+2? It is 4. "
                "Once upon a time there was a small model that served requests over HTTP.")


def write_tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama (float32 safetensors) with a small byte-level BPE tokenizer
    and a chat template: an HF directory `--model` accepts, loading in well under a second."""
    from checkpoints import save_random_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>",
                                        "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([_TINY_CORPUS] * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_TEMPLATE}))
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    save_random_checkpoint(config, path)
    return path


@cache
def tiny_model_dir() -> Path:
    return write_tiny_llama(Path(tempfile.mkdtemp(prefix="infer-tiny-llama-")))


def same_greedy_either_way(knob: str, check, logprob_tolerance: float, **flags) -> None:
    """The tiny model's greedy tokens with `EngineConfig.<knob>` off and then on (each engine
    built after the other, so none inherits the setting), `check(llm, on)` asserting what
    each engine set: the same tokens, logprobs within `logprob_tolerance`."""
    from infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = ["The tiny model says", "Once upon a time there was", "A"]
    outs = {}
    for on in (False, True):
        llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=64, max_model_len=128,
                  **flags, **{knob: on})
        check(llm, on)
        outs[on] = [(out.token_ids, [lp[t].logprob for t, lp in
                                     zip(out.token_ids, out.logprobs)])
                    for o in llm.generate(prompts, params, use_tqdm=False)
                    for out in o.outputs]
        del llm
    for (tokens, logprobs), (want, want_logprobs) in zip(outs[True], outs[False]):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < logprob_tolerance
