"""LLMEngine: requests in, one step at a time, RequestOutputs out.

Three parts, each in its own file:
- `InputProcessor`: prompt forms, tokenization and every check against the model, before
  anything is queued;
- `EngineCore`: scheduler + model runner + sampler, on sequences and token ids only;
- `OutputProcessor`: detokenizing, stop strings, logprob entries, outputs per request in
  its `output_kind` (cumulative, delta, final only).

A user request with `n` completions becomes `n` core sequences that share the prompt's
KV blocks; the output processor groups them back into one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from infer.engine.config import EngineConfig
from infer.engine.engine_core import EngineCore
from infer.engine.input_processor import InputProcessor, RequestRejected
from infer.engine.output_processor import OutputProcessor
from infer.engine.outputs import RequestOutput
from infer.engine.request import Request
from infer.engine.setup import load_model_and_tokenizer, pick_device_and_dtype
from infer.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestRejected"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.device, self.dtype = pick_device_and_dtype(config.device, config.dtype)
        self.model, self.model_config, self.tokenizer, self.model_name = (
            load_model_and_tokenizer(config.model, self.dtype, self.device)
        )
        torch.manual_seed(config.seed)
        mc = self.model_config
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                f"({mc.max_position_embeddings})"
            )
        if not config.chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"chunked_prefill=False needs max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) >= max_model_len ({self.max_model_len})"
            )
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self.core = EngineCore(config, self.model, mc, self.device, self.dtype,
                               self.max_model_len, self.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len,
                                              self.core.kv.pool.num_blocks, self.core.block_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_failed = 0  # charged with a failure of their own (`error` set)
        self._next_id = 0

    # the parts' state, for callers and tests that look inside
    @property
    def kv(self):
        return self.core.kv

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def attention_backend(self) -> str:
        return self.core.attention_backend

    @property
    def kernel_backend(self) -> str:
        return self.core.kernel_backend

    @property
    def graph_capture_seconds(self) -> float:
        return self.core.graph_capture_seconds

    @property
    def on_step_start(self) -> Callable[[], None] | None:
        return self.core.on_step_start

    @on_step_start.setter
    def on_step_start(self, hook: Callable[[], None] | None) -> None:
        self.core.on_step_start = hook

    # -- requests --------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: object,
                    params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it cannot be served.
        `prompt`: a string, token ids, {"prompt": str} or {"prompt_token_ids": [...]}."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.output_processor.groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        processed = self.input_processor.process(prompt, params)
        ids, now = processed.token_ids, time.monotonic()
        seq_ids, seq_params = [], []
        for i in range(params.n):
            seq_id = f"{request_id}#{i}" if params.n > 1 else request_id
            p = params
            if params.seed is not None and i > 0:
                p = dataclasses.replace(params, seed=params.seed + i)
            self.core.add(Request(seq_id, ids, processed.max_new_tokens, now,
                                  share_prefix_with=f"{request_id}#0" if i > 0 else None), p)
            seq_ids.append(seq_id)
            seq_params.append(p)
        self.output_processor.add(request_id, processed.text, ids, seq_ids, seq_params, now)
        self.prompt_tokens_total += len(ids)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self.output_processor.groups:
            return False
        for seq_id in self.output_processor.remove(request_id):
            self.core.finish(seq_id, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request with something to report
        (per its output kind). A request that failed alone gets a finished output with
        `error` set; a failure of the whole step aborts the requests it had scheduled and
        propagates (see EngineCore.step)."""
        try:
            updates = self.core.step()
        except BaseException:
            for request_id, group in list(self.output_processor.groups.items()):
                if any(s.seq_id not in self.core.sequences and s.finish_reason is None
                       for s in group.sequences):
                    self.abort_request(request_id)
            raise
        self.generation_tokens_total += sum(len(u.new_token_ids) for u in updates)
        processed = self.output_processor.process(updates, time.monotonic())
        for seq_id, reason, stop_reason in processed.to_finish:
            self.core.finish(seq_id, reason, stop_reason)
        self.num_requests_failed += sum(o.error is not None for o in processed.outputs)
        return processed.outputs

    # -- counters --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            **self.core.stats(),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_failed": self.num_requests_failed,
        }
