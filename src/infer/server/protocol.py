"""OpenAI wire format: request models (validated, strict types) and response models.

Fields a request model does not declare are accepted and ignored, as vLLM does: OpenAI
keeps adding fields (`service_tier`, `prompt_cache_key`, ...) that clients send and a
server need not act on. `ignored_fields()` names those of a request body and of its
`stream_options` (the server logs them and answers them in a header); extra keys of
messages and content parts are dropped silently (clients echo back what they received).
Declared fields keep strict types. Fields that OpenAI accepts but this server cannot
honour are declared and refused with a 400 when set to anything but their no-op value,
rather than silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from infer.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from infer.server.constraints import GUIDED, ConstraintError, output_constraint
from infer.structured_outputs import StructuredOutputsParams

MAX_N = 128
MAX_TEMPERATURE = 2.0


class RequestError(ValueError):
    """A 4xx with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = (
            message, param, status, code, type)


def error_body(message: str, type: str, code: str | int | None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, the same for every error the server answers."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra={"additionalProperties": True})
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        model = handler(data)
        if isinstance(data, dict):
            model._ignored = [str(k) for k in data if k not in cls.model_fields]
        return model

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value

    def ignored_fields(self) -> list[str]:
        """The fields of the body that were given but ignored, `stream_options.NAME` for
        those of its stream options."""
        names = list(self._ignored)
        options = getattr(self, "stream_options", None)
        if options is not None:
            names += [f"stream_options.{name}" for name in options._ignored]
        return names


def _check_unicode(value: Any) -> None:
    """JSON may escape a lone surrogate ("\\ud800"): valid JSON, but no text a tokenizer
    can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it has a lone surrogate)") from None
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class StreamOptions(_Request):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# Bounds in the types are checked on parse and shown in the OpenAPI schema; they mirror
# SamplingParams' own checks, which stay the authority.
Text = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _SamplingRequest(_Request):
    model: str | None = None  # absent: the server's first model (vLLM's; OpenAI requires it)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None \
        = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # extensions (vLLM's names), sent by the openai client through extra_body
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Output constraints (`constraints.py`): OpenAI's response_format and vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The output constraint asked for and the field that asked (None: none)."""
        names = ("response_format", "structured_outputs", *GUIDED)
        try:
            return output_constraint({name: getattr(self, name) for name in names})
        except ConstraintError as exc:
            raise RequestError(str(exc), exc.param) from None

    def _check_common(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs are not available with stream=true",
                               "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true",
                               "stream_options")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids written as strings."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias keys must be token ids (integers as strings), "
                               f"got {list(self.logit_bias)[:5]}", "logit_bias") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        constraint: tuple[StructuredOutputsParams, str] | None = None
                        ) -> SamplingParams:
        """`constraint`: what `constraint()` returned (read once per request)."""
        values: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "seed": self.seed, "stop": self.stop,
            "logprobs": logprobs, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": constraint[0] if constraint else None,
            "logit_bias": self._logit_bias(), "prompt_logprobs": self.prompt_logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            message = str(exc)
            param = max((k for k in values if message.startswith(k)), key=len, default=None)
            if param == "structured_outputs" and constraint is not None:
                param = constraint[1]
            raise RequestError(message, param) from None


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1)])
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    # 0 only with echo: the prompt scored, nothing generated (lm-eval's loglikelihood)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._check_common()
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise RequestError("max_tokens must be at least 1 (0 only with echo=true and "
                               "without stream, which returns the prompt scored)",
                               "max_tokens")
        if self.echo and self.stream and self.logprobs is not None:
            raise RequestError("echo with logprobs is not available with stream=true",
                               "echo")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # an earlier answer's reasoning, as clients send it back; templates that show it read it
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # as `inputs.text_messages` joins them offline
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Request):
    # exactly one of prompt and messages, not null
    model_config = ConfigDict(json_schema_extra={"additionalProperties": True, "oneOf": [
        {"required": [key], "properties": {key: {"type": kind}}}
        for key, kind in (("prompt", "string"), ("messages", "array"))]})
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: entry}
# for the token itself and the N most likely there.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _without_none(data: dict[str, Any], key: str) -> dict[str, Any]:
    if data.get(key) is None:
        data.pop(key, None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only when asked for

    @model_serializer(mode="wrap")
    def _without_absent_prompt_logprobs(self, handler: SerializerFunctionWrapHandler
                                        ) -> dict[str, Any]:
        return _without_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # OpenAI's shape: {"id", "type", "function": {"name", "arguments"}}, with "index" in
    # a stream's deltas (whose later pieces carry only index and arguments)
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extras(self, handler: SerializerFunctionWrapHandler
                               ) -> dict[str, Any]:
        """reasoning_content and tool_calls only where there are some."""
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut | None = None
    delta: ChatMessageOut | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only when asked for

    @model_serializer(mode="wrap")
    def _without_absent_prompt_logprobs(self, handler: SerializerFunctionWrapHandler
                                        ) -> dict[str, Any]:
        return _without_none(handler(self), "prompt_logprobs")


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "infer"
    max_model_len: int | None = None
    quantization: str | None = None  # the weights' format in effect: none | int8 | gguf
    kv_cache_dtype: str | None = None  # the KV cache's element type: bfloat16 | float8_e4m3fn


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
