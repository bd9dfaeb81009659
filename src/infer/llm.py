"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from infer.engine.llm_engine import LLMEngine
from infer.engine.outputs import RequestOutput
from infer.inputs import PromptType, TokensPrompt, is_single_prompt, text_messages
from infer.llm_args import engine_config
from infer.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]
# chat_template_content_format values: how list content reaches the template. Text parts
# are joined into a string either way ("openai" templates read strings too).
CONTENT_FORMATS = ("auto", "string", "openai")


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        """`config`: EngineConfig's fields, or the vLLM names `llm_args` maps onto them
        (enforce_eager, enable_prefix_caching, trust_remote_code, ...)."""
        self.engine = LLMEngine(engine_config(model, config))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, {"prompt": ...} or
        {"prompt_token_ids": ...}, or a list of them); outputs in prompt order."""
        many = isinstance(prompts, (list, tuple)) and not is_single_prompt(prompts)
        prompts = list(prompts) if many else [prompts]
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _as_params_list(sampling_params, len(prompts))]
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts)) if use_tqdm and len(prompts) > 1 else None
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self._add(prompt, sp))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    _raise_if_failed(out)
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # an exception mid-way must not leave requests holding blocks
                if rid not in finished:
                    self.engine.abort_request(rid)
        return [finished[rid] for rid in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (the model's, or
        `chat_template`: a template text or the name of one of the model's), then
        generate. Content may be a string or a list of text parts; `tools` and
        `chat_template_kwargs` reach the template, as in vLLM."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported (lora_request must be None)")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of "
                             f"{', '.join(CONTENT_FORMATS)}; got "
                             f"{chat_template_content_format!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[TokensPrompt] = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                text_messages(conversation), add_generation_prompt,
                chat_template=chat_template, tools=tools,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            # the template writes the special tokens: none are added (Tokenizer.encode_chat)
            prompts.append(TokensPrompt(prompt=text, prompt_token_ids=tok.encode(
                text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative text) each time the request advances."""
        params = dataclasses.replace(sampling_params or SamplingParams(),
                                     output_kind=RequestOutputKind.CUMULATIVE)
        rid = self._add(prompt, params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        _raise_if_failed(out)
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort_request(rid)

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        return self.engine.add_request(f"llm-{next(self._ids)}", prompt, params)


def _raise_if_failed(output: RequestOutput) -> None:
    if output.error is not None:
        raise RuntimeError(f"request {output.request_id} failed: {output.error}")


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)
