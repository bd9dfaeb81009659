"""Test helper: the real GGUF tokenizers, ours and transformers' (the reference), each
built once per test session (transformers needs ~10 s for Gemma's 262k-token vocabulary,
~30 s without hf_gguf's faster reads)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hf_gguf import fast_gguf_reads
from real_models import gemma3_gguf, smollm2_gguf

from infer.loader.errors import ModelLoadError
from infer.loader.tokenizer import Tokenizer


def gguf_path(name: str) -> Path:
    """Path of the real GGUF model `name` ("smollm2" or "gemma3"); skips if not installed."""
    try:
        return smollm2_gguf() if name == "smollm2" else gemma3_gguf()
    except (ModelLoadError, RuntimeError) as exc:
        pytest.skip(str(exc))


@cache
def gguf_reader(name: str) -> Any:
    """The file opened by our reader (`infer.loader.gguf_reader.GGUFFile`), shared."""
    from infer.loader.gguf_file import open_gguf

    return open_gguf(gguf_path(name))


@cache
def ours(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path(name))


@cache
def reference(name: str) -> Any:
    """transformers' tokenizer converted from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    path = gguf_path(name)
    with fast_gguf_reads():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def has_non_ascii_numeral(text: str) -> bool:
    return any(c.isnumeric() and not c.isascii() for c in text)


@cache
def digit_split_reference(name: str) -> Any:
    """transformers' SmolLM2 tokenizer with the one deliberate difference of ours: every
    numeric character is split off before the byte-level split, as llama.cpp does for
    `tokenizer.ggml.pre == "smollm"` (and SmolLM's own tokenizer.json, a StarCoder-style
    Digits + ByteLevel). transformers' GGUF conversion drops that step; with SmolLM2's
    single-digit vocabulary that only changes a non-ASCII numeral after a space
    (" ²": ours "Ġ", "Â²"; transformers "ĠÂ", "²")."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(reference(name).backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def reference_ids(name: str, text: str, add_special_tokens: bool = True) -> list[int]:
    """transformers' ids for `text`, but for the documented SmolLM2 numeral difference."""
    if name == "smollm2" and has_non_ascii_numeral(text):
        return digit_split_reference(name).encode(text, add_special_tokens=add_special_tokens).ids
    return reference(name).encode(text, add_special_tokens=add_special_tokens)


# Text that exercises pre-tokenizers, normalizers, byte fallback and added tokens.
CORPUS: tuple[str, ...] = (
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see—won't we?",
    " leading space",
    "trailing space ",
    "  two leading, three trailing   ",
    "multiple     spaces   inside",
    "line one\nline two\n\nline four\r\nwindows line\r\n",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    " " * 40 + "indented far",
    "\t\ttabs\tand\t spaces \t mixed\n",
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n    return -x\n",
    'for (int i = 0; i < n; ++i) {\n\tprintf("%d\\n", a[i]);\n}',
    "Numbers: 0 7 42 123 2024 3.14159 1,000,000 -17 1e-9 0x1F 007 v2.0.1 10%",
    "Numerals: x² ½ ١٢٣ 一二三 Ⅻ ①",
    "12345678901234567890",
    "Accents: café naïve résumé São Paulo Ångström Ærø Zürich façade",
    "Combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0352\u0353",
    "CJK: 你好，世界！日本語のテキスト。한국어 문장입니다.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🧑‍💻",
    "RTL: مرحبا بالعالم שלום עולם",
    "Rare: 𓀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \ue000 \u200b zero\u200bwidth \ufeffbom",
    "Control: \x00\x01\x07\x1b[0m\x7f",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "ALL CAPS SHOUTING, MiXeD cAsE, snake_case, camelCase, kebab-case",
    "Punctuation!!! ??? ... ,,, ;;; ::: ''' \"\"\" ``` ~~~ ### $$$ %%% ^^^ &&& ***",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "<|im_start|<|im_start|>><|im_end",
    "<bos>Hello<eos> <pad> <unk> <mask>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "[multimodal] <unused0> <start_of_image>",
    "< bos> <bos <|im_start |>",
)
