"""Tokenizer: ours against transformers' on the real GGUF vocabularies and on HF dirs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from reference_tokenizers import (
    CORPUS,
    gguf_path,
    gguf_reader,
    has_non_ascii_numeral,
    ours,
    reference,
    reference_ids,
)
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from infer.loader.errors import ModelLoadError
from infer.loader.gguf_tokenizer import derive_merges, read_gguf_vocab
from infer.loader.tokenizer import Tokenizer

MODELS = ("smollm2", "gemma3")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(name: str, add_special_tokens: bool) -> None:
    tok = ours(name)
    for text in CORPUS:
        expected = reference_ids(name, text, add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text
    batch = tok.encode_batch(list(CORPUS), add_special_tokens=add_special_tokens)
    assert batch == [tok.encode(t, add_special_tokens=add_special_tokens) for t in CORPUS]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(name: str, skip: bool) -> None:
    tok, ref = ours(name), reference(name)
    for text in CORPUS:
        ids = ref.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip), text
    # arbitrary id sequences: partial UTF-8 bytes, special tokens anywhere
    rng = random.Random(0)
    specials = sorted(tok.special_token_ids)[:50]
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("name", MODELS)
def test_round_trip(name: str) -> None:
    tok = ours(name)
    for text in CORPUS:
        if "\x00" in text or "\ufeff" in text:
            continue
        assert tok.decode(tok.encode(text, add_special_tokens=False),
                          skip_special_tokens=False) == text


@pytest.mark.parametrize("name", MODELS)
def test_special_ids_match_transformers(name: str) -> None:
    tok, ref = ours(name), reference(name)
    assert tok.bos_token == ref.bos_token and tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token == ref.eos_token and tok.eos_token_id == ref.eos_token_id
    assert tok.pad_token_id == ref.pad_token_id and tok.unk_token_id == ref.unk_token_id
    assert tok.vocab_size == len(ref)
    assert tok.special_tokens == ref.special_tokens_map
    assert tok.chat_template == ref.chat_template
    assert tok.special_token_ids == {i for i, t in ref.added_tokens_decoder.items() if t.special}


def test_smollm2_numerals_split_as_llama_cpp() -> None:
    """The one known difference from transformers (see reference_tokenizers.py)."""
    tok, ref = ours("smollm2"), reference("smollm2")
    pieces = [tok.id_to_token(i) for i in tok.encode("a ² b")]
    assert pieces == ["a", "Ġ", "Â²", "Ġb"]
    assert tok.encode("a ² b") != ref.encode("a ² b")
    differing = [t for t in CORPUS if tok.encode(t) != ref.encode(t)]
    assert differing and all(has_non_ascii_numeral(t) for t in differing)
    assert tok.encode("x² 12 007") == ref.encode("x² 12 007")  # ASCII digits: no difference


def test_smollm2_ids_and_config() -> None:
    """SmolLM2's ids as the model (and its GGUF-derived ModelConfig) expects them."""
    from infer.loader.gguf_metadata import gguf_config

    reader = gguf_reader("smollm2")
    config = gguf_config(reader)
    tok = ours("smollm2")
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_ids, tok.pad_token_id) == ("<|im_end|>", (2,), 2)
    assert tok.bos_token_id == config.bos_token_id
    assert tok.eos_token_ids == config.eos_token_ids
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)  # no BOS added
    # a file already open gives the same tokenizer
    from_reader = Tokenizer.from_gguf(reader)
    assert from_reader.special_tokens == tok.special_tokens
    assert [from_reader.encode(t) for t in CORPUS] == [tok.encode(t) for t in CORPUS]


def test_gemma3_ids() -> None:
    tok = ours("gemma3")
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token_ids) == ("<bos>", 2, (1,))
    assert tok.pad_token_id == 0 and tok.chat_template is None
    assert tok.encode("") == [2]
    assert tok.encode("Hi")[0] == 2 and tok.encode("Hi")[1:] == tok.encode("Hi", False)


def test_gguf_vocab_from_a_path_or_an_open_file() -> None:
    """The metadata alone (the tokenizer's reading) and the whole file read the same
    vocabulary (both are checked against the gguf package in test_gguf_reader.py)."""
    alone, whole = read_gguf_vocab(gguf_path("smollm2")), read_gguf_vocab(gguf_reader("smollm2"))
    assert alone == whole


def test_gguf_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Tokenizer.from_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path("smollm2").read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        Tokenizer.from_gguf(truncated)


def test_derive_merges_order() -> None:
    ids = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    scores = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -1.0, "abc": -2.0}
    # best score first; equal scores keep vocabulary order; longer left piece first
    assert derive_merges(ids, scores) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


# --- HF directories


def test_hf_dir_from_transformers_save(tmp_path: Path) -> None:
    """transformers' GGUF-derived SmolLM2 tokenizer saved as an HF dir, loaded by us."""
    ref = reference("smollm2")
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for add in (True, False):
        assert [tok.encode(t, add) for t in CORPUS] == [
            ref.encode(t, add_special_tokens=add) for t in CORPUS]
    for text in CORPUS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.chat_template == ref.chat_template  # from chat_template.jinja
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2, 0), 2)
    chat = [{"role": "user", "content": "Hello!"}]
    assert tok.encode_chat(chat) == ref.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=False)


def _tiny_backend(post_bos: bool) -> Backend:
    """A small byte-level BPE (GPT-2 style) trained on a few sentences."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator([" ".join(CORPUS)] * 3, trainer)
    if post_bos:
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return backend


def test_hf_dir_config_files(tmp_path: Path) -> None:
    """tokenizer_config.json: special tokens as AddedToken dicts, add_bos_token used only
    when tokenizer.json has no post-processor, list-form templates, cleanup flag."""
    _tiny_backend(post_bos=False).save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "special": True, "__type": "AddedToken"},
        "eos_token": "</s>",
        "image_token": "<image>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "{{ tools | tojson }}{{ image_token }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    bos = tok.token_to_id("<s>")
    assert tok.bos_token_id == bos and tok.encode("hi")[0] == bos
    assert tok.encode("hi", add_special_tokens=False)[0] != bos
    assert tok.special_tokens["image_token"] == "<image>"
    image = tok.token_to_id("<image>")  # added as a whole special token
    assert image is not None and image in tok.special_token_ids
    chat = [{"role": "user", "content": "hey"}]
    assert tok.apply_chat_template(chat) == "<s>hey"
    assert tok.encode_chat(chat).count(bos) == 1
    tools = [{"name": "f"}]
    assert tok.apply_chat_template(chat, tools=tools) == '[{"name": "f"}]<image>'
    assert tok.apply_chat_template(chat, chat_template="tool_use") == "null<image>"
    # a post-processor in tokenizer.json wins over the flags (transformers >= 5)
    _tiny_backend(post_bos=True).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert Tokenizer.from_hf_dir(tmp_path).encode("hi")[0] == bos
    # template files take priority over tokenizer_config's templates
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert Tokenizer.from_hf_dir(tmp_path).chat_templates == {"default": "jinja"}


def test_hf_dir_cleanup_only_for_non_bpe(tmp_path: Path) -> None:
    backend = Backend(models.WordLevel({"hello": 0, "!": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken("[CLS]", special=True)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "cls_token": "[CLS]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.decode(tok.encode("hello !")) == "hello!"
    bpe_dir = tmp_path / "bpe"
    bpe_dir.mkdir()
    _tiny_backend(post_bos=False).save(str(bpe_dir / "tokenizer.json"))
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(config))
    bpe = Tokenizer.from_hf_dir(bpe_dir)
    assert bpe.decode(bpe.encode("hello !")) == "hello !"


def test_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


# --- other GGUF tokenizer kinds, on small vocabularies written here


def _write_tokenizer_gguf(path: Path, model: str, tokens: list[str], types: list[int],
                          scores: list[float] | None = None, merges: list[str] | None = None,
                          pre: str | None = None, add_bos: bool | None = None) -> Path:
    """A GGUF with a tokenizer and the least of a Llama model transformers wants to see."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _trained(pre_tokenizer: pre_tokenizers.PreTokenizer, **trainer_args: object) -> dict:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, **trainer_args)
    backend.train_from_iterator(list(CORPUS) * 3, trainer)
    return json.loads(backend.to_str())["model"]


def _assert_same_as_transformers(path: Path, bos_differs: bool = False) -> Tokenizer:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer.from_gguf(path)
    assert tok.special_tokens == ref.special_tokens_map
    for text in CORPUS:
        assert tok.encode(text, False) == ref.encode(text, add_special_tokens=False), text
        if not bos_differs:
            assert tok.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
    return tok


def test_gguf_sentencepiece_llama(tmp_path: Path) -> None:
    """A Llama-2-style vocabulary: ▁ pieces with scores, byte tokens, no merges in the
    file (derived from the scores), BOS added by default."""
    trained = _trained(pre_tokenizers.Metaspace(), limit_alphabet=200)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *[6] * 256]
    scores = [0.0] * len(tokens)
    for piece, rank in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    path = _write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores)
    tok = _assert_same_as_transformers(path)
    assert tok.encode("hi")[0] == 1 and tok.decode(tok.encode("hi there")) == "hi there"
    assert tok.encode(" hi") == tok.encode("hi")  # Metaspace adds no second ▁


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2", "llama-bpe"])
def test_gguf_byte_level_pre_tokenizers(tmp_path: Path, pre: str) -> None:
    trained = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False),
                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|unk|>", "<|im_start|>", "<|endoftext|>"]
    tokens += [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])]
    tokens += ["<think>", "<｜fullwidth▁control｜>"]
    types = [3, 3, 3, *[1] * (len(tokens) - 5), 4, 3]
    merges = [" ".join(m) for m in trained["merges"]]
    path = _write_tokenizer_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, types,
                                 merges=merges, pre=pre)
    # llama.cpp adds BOS for a llama-bpe file without the flag; transformers does not
    tok = _assert_same_as_transformers(path, bos_differs=pre == "llama-bpe")
    assert tok.encode("hi")[:1] == ([1] if pre == "llama-bpe" else tok.encode("hi", False)[:1])
    assert tok.encode("<think>", False) == [tokens.index("<think>")]
    assert tok.backend.model.ignore_merges == (pre == "llama-bpe")
    explicit = _write_tokenizer_gguf(tmp_path / "flag.gguf", "gpt2", tokens, types,
                                     merges=merges, pre=pre, add_bos=False)
    _assert_same_as_transformers(explicit)
