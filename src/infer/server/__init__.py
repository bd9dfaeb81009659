"""The OpenAI-compatible HTTP server: `build_app(AsyncEngine.launch(EngineConfig(...)))`."""

from infer.server.app import attach_engine, build_app
from infer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "attach_engine", "build_app"]
