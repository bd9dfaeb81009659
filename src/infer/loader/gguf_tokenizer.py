"""A `tokenizers.Tokenizer` rebuilt from the vocabulary a GGUF file stores as metadata.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys. We rebuild the
tokenizer transformers builds from them (its GGUF integration is the reference the tests
compare against), except where its conversion drops a rule that llama.cpp (whose format
this is) and the model's own tokenizer.json apply: digits split one by one for
StarCoder-style vocabularies (`_DIGIT_PRE`, SmolLM's), and Llama 3's `ignore_merges` and
default BOS (`_LLAMA3_PRE`).

- `gpt2`: byte-level BPE with the file's merges, split per `tokenizer.ggml.pre`.
- `llama`: SentencePiece vocabulary as BPE with byte fallback; merges are taken from the
  file or derived from the vocabulary (`derive_merges`). Gemma files get Gemma's
  normalizer and their own merge order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from infer.loader.errors import ModelLoadError
from infer.loader.gguf_reader import GGUFFile, GGUFFormatError, read_metadata

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL = 3
USER_DEFINED = 4

_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA3 pre-tokenizer: besides the split, it ignores merges for a word that is
# itself in the vocabulary (as Llama 3's tokenizer.json does) and adds BOS unless the file
# says otherwise. transformers' GGUF conversion does neither.
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2", "jina-v5-nano")
_SPLITS = {
    **dict.fromkeys((*_LLAMA3_PRE, "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Pre-tokenizers that isolate every numeric character before the GPT-2 split (llama.cpp's
# rule for these; SmolLM's and StarCoder's tokenizer.json: Digits + ByteLevel).
_DIGIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of one GGUF file."""

    source: str
    architecture: str
    model: str
    pre: str | None
    tokens: list[str]
    scores: list[float] | None
    token_types: list[int] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    eom_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def read_gguf_vocab(source: str | Path | GGUFFile) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file (a path, or one open with `gguf_reader`)."""
    if isinstance(source, GGUFFile):
        name, meta = str(source.path), source.fields
    else:
        name = str(source)
        meta = _read_metadata(Path(source))
    return _vocab_from_metadata(meta, name)


def _vocab_from_metadata(meta: dict[str, Any], source: str) -> GGUFVocab:
    def get(key: str) -> Any:
        return meta.get(f"tokenizer.ggml.{key}")

    tokens = get("tokens")
    model = get("model")
    if not isinstance(tokens, list) or not tokens or model is None:
        raise ModelLoadError(f"{source}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    pre = get("pre")
    add_bos = get("add_bos_token")
    if add_bos is None:
        # llama.cpp's defaults for files without the flag
        add_bos = model == "llama" or pre in _LLAMA3_PRE
    n = len(tokens)
    ids = {key: (int(v) if v is not None and 0 <= int(v) < n else None)
           for key in ("bos", "eos", "unknown", "padding", "eot", "eom")
           for v in [get(f"{key}_token_id")]}
    return GGUFVocab(
        source=source,
        architecture=str(meta.get("general.architecture", "")),
        model=str(model),
        pre=pre,
        tokens=tokens,
        scores=get("scores"),
        token_types=get("token_type"),
        merges=get("merges"),
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        unk_id=ids["unknown"],
        pad_id=ids["padding"],
        eot_id=ids["eot"],
        eom_id=ids["eom"],
        add_bos=bool(add_bos),
        add_eos=bool(get("add_eos_token") or False),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _read_metadata(path: Path) -> dict[str, Any]:
    try:
        return read_metadata(path)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (GGUFFormatError, OSError, ValueError) as exc:  # ValueError: an empty file
        raise ModelLoadError(f"{path}: {exc}") from None


# --- building the tokenizer


def build_gguf_backend(vocab: GGUFVocab) -> Backend:
    """The `tokenizers.Tokenizer` the vocabulary describes, special tokens and BOS/EOS
    post-processing included."""
    if vocab.model == "gpt2":
        backend = _byte_level(vocab)
    elif vocab.model == "llama" and vocab.architecture in _GEMMA_ARCHS:
        backend = _gemma(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece(vocab)
    else:
        raise ModelLoadError(
            f"{vocab.source}: GGUF tokenizer model {vocab.model!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    _add_special_tokens(backend, vocab)
    backend.post_processor = template_processor(
        vocab.token(vocab.bos_id) if vocab.add_bos else None,
        vocab.bos_id,
        vocab.token(vocab.eos_id) if vocab.add_eos else None,
        vocab.eos_id,
    )
    return backend


def template_processor(bos: str | None, bos_id: int | None, eos: str | None,
                       eos_id: int | None) -> processors.TemplateProcessing:
    """BOS before / EOS after each sequence (either may be None)."""
    def around(seq: str, type_id: int) -> str:
        pre = f"{bos}:{type_id} " if bos is not None else ""
        post = f" {eos}:{type_id}" if eos is not None else ""
        return f"{pre}{seq}:{type_id}{post}"

    single = around("$A", 0)
    pair = f"{single} {around('$B', 1)}"
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted
    past U+0100 so that every byte is one visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_ALPHABET = _bytes_to_unicode()
_BYTE_CHARS = frozenset(_BYTE_ALPHABET.values())


def _byte_level(vocab: GGUFVocab) -> Backend:
    if not vocab.merges:
        raise ModelLoadError(f"{vocab.source}: byte-level BPE vocabulary without merges")
    # A token written outside the byte alphabet (llama.cpp stores some as plain text) is
    # respelled byte by byte.
    ids = {
        (t if set(t) <= _BYTE_CHARS else "".join(_BYTE_ALPHABET[b] for b in t.encode())): i
        for i, t in enumerate(vocab.tokens)
    }
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    backend = Backend(BPE(vocab=ids, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False,
                          ignore_merges=vocab.pre in _LLAMA3_PRE))
    split = _SPLITS.get(vocab.pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif vocab.pre in _DIGIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


_SPM_DECODER = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]


def _sentencepiece(vocab: GGUFVocab) -> Backend:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.merges:
        merges = [tuple(m.split(" ")) for m in vocab.merges]
    elif vocab.scores is not None:
        merges = derive_merges(ids, dict(zip(vocab.tokens, vocab.scores)))
    else:
        raise ModelLoadError(f"{vocab.source}: SentencePiece vocabulary without scores or merges")
    backend = Backend(BPE(vocab=ids, merges=merges, fuse_unk=True, byte_fallback=True,
                          dropout=None))
    if vocab.architecture == "phi3":
        # Phi-3's prefix space comes from a normalizer: "  hi" -> "▁▁▁hi"
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence([*_SPM_DECODER, decoders.Strip(" ", 1, 0)])
    return backend


def _gemma(vocab: GGUFVocab) -> Backend:
    # Gemma files store tokens of 2+ spaces as real spaces while the normalizer turns every
    # space into "▁"; and their merge order is the order of the tokens in the file, not
    # their scores.
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    merges = derive_merges(ids, {t: -i for i, t in enumerate(tokens)})
    backend = Backend(BPE(vocab=ids, merges=merges, fuse_unk=True, unk_token="<unk>",
                          byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(_SPM_DECODER)
    return backend


def derive_merges(ids: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens, best score first, then the longer left piece, then vocabulary order
    (transformers' rule, so that the merge ranks, and with them the encodings, agree)."""
    candidates: list[tuple[float, int, int, int, str, str]] = []
    for seq, (piece, score) in enumerate(scores.items()):
        for k in range(1, len(piece)):
            left = piece[:k]
            if left in ids:
                right = piece[k:]
                if right in ids:
                    candidates.append((score, k, len(right), -seq, left, right))
    # (score, left length, right length, -seq) is unique per candidate, so the strings
    # never get compared
    candidates.sort(reverse=True)
    return [(c[4], c[5]) for c in candidates]


def _add_special_tokens(backend: Backend, vocab: GGUFVocab) -> None:
    """Control tokens become special added tokens (matched whole, skipped when decoding
    with skip_special_tokens); user-defined ones become plain added tokens."""
    types = vocab.token_types or []
    byte_level = vocab.model == "gpt2"
    # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp
    # mislabel; adding it would grow the vocabulary past the embedding.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(vocab.tokens, types)
        if kind == CONTROL and (not byte_level or set(t) <= _BYTE_CHARS)
    ]
    if control:
        backend.add_special_tokens(control)
    known = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(vocab.tokens, types) if kind == USER_DEFINED and t in known]
    if user:
        backend.add_tokens(user)
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    named = [vocab.token(i) for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id)]
    missing = [AddedToken(t, normalized=False, special=True)
               for t in dict.fromkeys(named) if t is not None and t not in added]
    if missing:
        backend.add_special_tokens(missing)
