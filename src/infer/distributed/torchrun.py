"""Ranks started by torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in the
environment), on one host or several: rank 0 runs the command (`infer serve`, ...) and
meets the others at `env://`; every other rank runs a worker. No torch at import: the CLI
asks before it loads anything."""

from __future__ import annotations

import os

from infer.engine.config import EngineConfig


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (None: it did not)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def run_torchrun_worker(config: EngineConfig) -> None:
    """This process as the worker torchrun started (`RANK` > 0); its GPU is `LOCAL_RANK`
    of its host."""
    import torch

    from infer.distributed.worker import worker_main

    device = "cpu"
    if config.device != "cpu" and torch.cuda.is_available():
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    worker_main(config, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://",
                device)
