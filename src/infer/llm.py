"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.outputs import RequestOutput
from infer.inputs import PromptType, is_single_prompt
from infer.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
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
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
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
