"""The engine's tokenizer: HF `tokenizers` underneath, chat templates on top.

Built from an HF model directory (tokenizer.json and its configs) or from a GGUF file's
vocabulary (`gguf_tokenizer`). Encodings, decodings and rendered chats match
transformers' (`AutoTokenizer`) for the same files; tests/test_tokenizer.py checks that.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

from infer.loader.chat_template import ChatTemplateError, Message, render_chat_template
from infer.loader.errors import ModelLoadError
from infer.loader.gguf_reader import GGUFFile
from infer.loader.gguf_tokenizer import build_gguf_backend, read_gguf_vocab, template_processor
from infer.loader.hf_dir import read_json
from infer.loader.token_bound import max_bytes_per_token

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Encode/decode text and render chats for one model.

    `special_tokens` maps names (bos_token, eos_token, pad_token, ..., and model-specific
    ones like image_token) to token strings; all are chat-template variables.
    `eos_token_ids` is every id that ends generation: the eos token's first, then the
    model's others (generation_config.json, GGUF end-of-turn ids).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_ids: Sequence[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        source: str = "",
    ) -> None:
        self.backend = backend
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._add_missing_special_tokens()
        eos_id = self.token_to_id(self.eos_token) if self.eos_token is not None else None
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            [*([eos_id] if eos_id is not None else []), *(int(i) for i in extra_eos_ids)]
        ))
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
        self._max_bytes_per_token = max_bytes_per_token(backend)
        # transformers skips this cleanup for BPE models: it would eat real spaces
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    # --- construction

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From tokenizer.json, tokenizer_config.json (special tokens, chat template),
        chat_template.jinja / additional_chat_templates/ / chat_template.json, and
        generation_config.json (extra EOS ids)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{path}: no tokenizer.json (infer needs a `tokenizers` tokenizer; convert a slow "
                "one with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d))"
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON/models
            raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer ({exc})") from None
        config_file = path / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        special = _special_tokens_from_config(config)
        if backend.post_processor is None:
            # transformers >= 5 ignores these flags when tokenizer.json exists; they matter
            # only for a tokenizer.json without a post-processor (transformers 4 applied them).
            bos = special.get("bos_token") if config.get("add_bos_token") else None
            eos = special.get("eos_token") if config.get("add_eos_token") else None
            if bos is not None or eos is not None:
                backend.post_processor = template_processor(
                    bos, backend.token_to_id(bos) if bos else None,
                    eos, backend.token_to_id(eos) if eos else None,
                )
        return cls(
            backend,
            special_tokens=special,
            extra_eos_ids=_model_eos_ids(path),
            chat_template=_chat_templates_from_dir(path, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            source=str(path),
        )

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFFile) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata (a path or an open reader)."""
        vocab = read_gguf_vocab(source)
        backend = build_gguf_backend(vocab)
        special = {
            name: token
            for name, token_id in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                                   ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id))
            if (token := vocab.token(token_id)) is not None
        }
        if vocab.architecture.startswith("gemma") and "<mask>" in vocab.tokens:
            special["mask_token"] = "<mask>"  # transformers' GemmaTokenizer default
        return cls(
            backend,
            special_tokens=special,
            extra_eos_ids=[i for i in (vocab.eot_id, vocab.eom_id) if i is not None],
            chat_template=vocab.chat_template,
            source=vocab.source,
        )

    def _add_missing_special_tokens(self) -> None:
        """Named special tokens must be whole, special added tokens (transformers adds
        the ones tokenizer.json does not list)."""
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, normalized=False, special=True)
                   for t in dict.fromkeys(self.special_tokens.values()) if t not in added]
        if missing:
            self.backend.add_special_tokens(missing)

    # --- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_id("unk_token")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that decode(skip_special_tokens=True) drops."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    # --- text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` adds the BOS/EOS the tokenizer is configured to add.

        Through the batch call: unlike `Backend.encode` it releases the GIL (a long text
        does not stall the other threads, e.g. a server's event loop) and skips offsets."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch_fast(list(texts),
                                                   add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def min_token_count(self, text: str) -> int:
        """A lower bound on `len(encode(text))` from the text's length alone (0 when this
        tokenizer allows no bound): proves a text too long without tokenizing it."""
        if self._max_bytes_per_token is None:
            return 0
        return int(len(text.encode("utf-8")) // self._max_bytes_per_token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def decode_stream(self, skip_special_tokens: bool = True
                      ) -> Callable[[int], str | None] | None:
        """An incremental decoder in Rust (`tokenizers`' DecodeStream): step(id) returns
        the new text, or None while it ends in an incomplete character. None where
        `decode` post-processes the text (space cleanup), which a stream would not do."""
        if self._clean_up:
            return None
        return partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self.backend)

    # --- chat

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None if the model has none."""
        return self.chat_templates.get("default")

    def get_chat_template(self, chat_template: str | None = None,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """A template's text: `chat_template` names one of the model's templates or is a
        template itself; by default the model's (its "tool_use" one when tools are given)."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(
                f"{self.source}: the model has several chat templates and no default; name one of "
                f"{sorted(self.chat_templates)}"
            )
        raise ChatTemplateError(
            f"{self.source}: the model has no chat template (a base model?); use plain "
            "completions, or pass a chat template"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The chat as text, as transformers' `apply_chat_template(tokenize=False)` renders
        it. `continue_final_message` leaves the last message open for the model to continue
        (and so adds no generation prompt); other kwargs are template variables."""
        return render_chat_template(
            self.get_chat_template(chat_template, tools),
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            tools=tools,
            documents=documents,
            **kwargs,
        )

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat. The template writes every special token the
        model wants (a BOS included), so none are added: adding them would give a template
        that starts with `{{ bos_token }}` two BOS tokens. Same as transformers'
        `apply_chat_template(tokenize=True)`."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]  # a serialised AddedToken
    return None


def _special_tokens_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    """Named special tokens, plus model-specific `*_token` entries and a dict of
    `extra_special_tokens` (image_token, ...), which transformers also hands to templates."""
    extra = config.get("extra_special_tokens")
    entries = {**config, **(extra if isinstance(extra, Mapping) else {})}
    special = {}
    for key, value in entries.items():
        if key in NAMED_SPECIAL_TOKENS or (key.endswith("_token") and not key.startswith("add_")):
            token = _token_content(value)
            if token is not None:
                special[key] = token
    return special


def _chat_templates_from_dir(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Template files take priority over tokenizer_config.json entries (as in transformers):
    chat_template.jinja is the default, additional_chat_templates/NAME.jinja named ones;
    else chat_template.json (processors' legacy file); else tokenizer_config's
    `chat_template` (a string, or a list of {name, template})."""
    templates: dict[str, str] = {}
    default = path / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    legacy = path / "chat_template.json"
    value = read_json(legacy).get("chat_template") if legacy.is_file() else None
    if value is None:
        value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        try:
            return {str(t["name"]): str(t["template"]) for t in value}
        except (KeyError, TypeError):
            raise ModelLoadError(
                f"{path}: chat_template list entries need 'name' and 'template'"
            ) from None
    if value is not None:
        raise ModelLoadError(f"{path}: chat_template is neither a string nor a list")
    return {}


def _model_eos_ids(path: Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            try:
                value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                continue
            if value is not None:
                values = value if isinstance(value, list) else [value]
                return [int(v) for v in values]
    return []
