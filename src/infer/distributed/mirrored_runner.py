"""Rank 0's model runner under tensor parallelism.

Every call that runs the model is first announced to the other ranks (one pickled tuple
through `channel.py`; the step's token ids, when they are already on the device, by a
device broadcast), which make the same call on their shards (`worker.serve`); then rank 0
makes it. So the collectives inside the model (each row-parallel all-reduce, the LM
head's gather) meet in the same order on every rank. Everything else (`prepare`, the
graphs' state, the model for inspection) is the wrapped runner's.

A failure on any rank during a call leaves the ranks out of step for good: the runner
then raises `TensorParallelError` on every call, and the engine stops (`core_process`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from infer.distributed.group import TensorParallelGroup
from infer.distributed.workers import TensorParallelError, Workers
from infer.engine.model_runner import ModelRunner, StepInputs


class MirroredRunner:
    def __init__(self, runner: ModelRunner, tp: TensorParallelGroup, workers: Workers) -> None:
        self.runner, self.tp, self.workers = runner, tp, workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, inputs: StepInputs, device_input_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        num_ids = 0 if device_input_ids is None else device_input_ids.numel()
        dtype = "" if device_input_ids is None else \
            str(device_input_ids.dtype).removeprefix("torch.")
        return self._mirrored(("forward", inputs, num_ids, dtype), self._forward, inputs,
                              device_input_ids)

    def _forward(self, inputs: StepInputs, device_input_ids: torch.Tensor | None
                 ) -> torch.Tensor:
        if device_input_ids is not None:
            self.tp.broadcast(device_input_ids)
        return self.runner.forward(inputs, device_input_ids)

    def sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return self._mirrored(("logits",), self.runner.sample_logits, hidden, inputs)

    def execute(self, inputs: StepInputs, device_input_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.sample_logits(self.forward(inputs, device_input_ids), inputs)

    def logits_of_rows(self, hidden: torch.Tensor, rows: list[int], chunk: int
                       ) -> Iterator[torch.Tensor]:
        chunks = self._mirrored(("rows", rows, chunk), self.runner.logits_of_rows, hidden,
                                rows, chunk)
        try:
            yield from chunks
        except Exception as exc:
            raise self._broke(exc) from exc

    def _mirrored(self, message: tuple, call: Any, *args: Any) -> Any:
        self.workers.check()
        try:
            self.workers.channel.send(message)
            return call(*args)
        except Exception as exc:
            raise self._broke(exc) from exc

    def _broke(self, exc: Exception) -> TensorParallelError:
        """The ranks are out of step for good: every later call raises (`Workers.check`)."""
        self.workers.fail(self.workers.exited() or (
            f"a tensor-parallel model call failed on rank 0 ({type(exc).__name__}: {exc}); "
            "the ranks are out of step and the engine cannot go on"))
        return TensorParallelError(self.workers.failure)
