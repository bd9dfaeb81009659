"""infer's log lines (what the engine chose and why: batch sizes, threads, quantization) on
stderr at INFO, as vLLM prints its own, unless the application has set up logging itself
(the root logger has a handler) or INFER_CONFIGURE_LOGGING=0."""

from __future__ import annotations

import logging
import os

FORMAT = "%(levelname)s infer: %(message)s"


def configure_logging() -> None:
    logger = logging.getLogger("infer")
    if (os.environ.get("INFER_CONFIGURE_LOGGING", "1") == "0" or logger.handlers
            or logging.getLogger().handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
