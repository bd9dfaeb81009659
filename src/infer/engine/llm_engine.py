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

import time
import weakref
from collections.abc import Callable

import torch

from infer.engine.config import EngineConfig
from infer.engine.core_loading import CoreInfo, load_core
from infer.engine.core_process import CoreClient, RemoteCore
from infer.engine.engine_core import EngineCore
from infer.engine.input_processor import InputProcessor, RequestRejected, split_into_sequences
from infer.engine.output_processor import OutputProcessor
from infer.engine.outputs import RequestOutput
from infer.engine.setup import load_tokenizer
from infer.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestRejected"]


class LLMEngine:
    """With `config.core_process`, the core runs in a process of its own behind a pipe
    (`RemoteCore`); its model and cache are then not reachable from here."""

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.core: EngineCore | RemoteCore
        if config.core_process:
            client, self.info = CoreClient.spawn(config)
            weakref.finalize(self, client.shutdown)  # an engine let go stops its core
            self.core, self.tokenizer = RemoteCore(client), load_tokenizer(config.model)
            self.model_name = self.info.model_name
            self.model = self.model_config = None
            self.device = torch.device(self.info.device)
            self.dtype = getattr(torch, self.info.dtype)
        else:
            self.core, self.tokenizer, self.model_name = load_core(config)
            if self.core.workers is not None:  # an engine let go stops its ranks
                weakref.finalize(self, self.core.workers.shutdown)
            self.info = CoreInfo.of(self.core, self.model_name)
            self.model = self.core.runner.model
            self.model_config = self.core.model_config
            self.device, self.dtype = self.core.device, self.core.dtype
        self.max_model_len = self.info.max_model_len
        self.input_processor = InputProcessor.for_core(self.tokenizer, self.info)
        if isinstance(self.core, EngineCore):
            self.input_processor.structured_outputs = self.core.structured_outputs
        self.output_processor = OutputProcessor(self.tokenizer)
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
        now = time.monotonic()
        sequences = split_into_sequences(request_id, processed, now)
        for request, seq_params in sequences:
            self.core.add(request, seq_params)
        self.output_processor.add(request_id, processed.text, processed.token_ids,
                                  [r.request_id for r, _ in sequences],
                                  [p for _, p in sequences], now)
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
        processed = self.output_processor.process(updates, time.monotonic())
        for seq_id, reason, stop_reason in processed.to_finish:
            self.core.finish(seq_id, reason, stop_reason)
        return processed.outputs

    # -- counters --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {**self.core.stats(), **self.output_processor.stats()}

    @property
    def num_requests_failed(self) -> int:
        return self.output_processor.num_requests_failed

    def shutdown(self) -> None:
        """Stop a core process or the tensor-parallel workers of a core in here (at exit
        otherwise)."""
        self.core.shutdown()
