"""The step loop's host time by phase, on any device: named methods wrapped with a timer
that records while a label is set (`LoopPhases.label`, e.g. a batch size and a
constraint), then the median µs a call of each, by label. The wrapper
(`timing.wrap_timed`) costs ~1 µs a call.

`structured_output.py --loop-phases` prints it for its timed runs; on CUDA it says where
the launch's host work goes (its forward's graph is queued only once that work is done).
"""

from __future__ import annotations

import importlib
import statistics
from collections import defaultdict

from timing import wrap_timed

# (module, class or None for a module's function, attribute), outermost first
PHASES = (
    ("infer.engine.engine_core", "EngineCore", "step"),
    ("infer.engine.engine_core", "EngineCore", "_try_launch_ahead"),
    ("infer.engine.scheduler", "Scheduler", "schedule_ahead"),
    ("infer.engine.model_runner", "ModelRunner", "prepare"),
    ("infer.engine.engine_core", "EngineCore", "_launch"),
    ("infer.engine.model_runner", "ModelRunner", "forward"),
    ("infer.attention.graph_metadata", "GraphMetadata", "prepare_replay"),
    ("infer.attention.step_staging", "StepStaging", "send_with_tables"),
    ("torch.cuda", "CUDAGraph", "replay"),
    ("infer.engine.engine_core", "EngineCore", "_sample"),
    ("infer.engine.engine_core", "EngineCore", "_sampling_batch"),
    ("infer.engine.engine_core", None, "sample"),
    ("infer.transfer", "HostCopy", "__init__"),
    ("infer.engine.grammar_process", "GrammarProcess", "masks"),
    ("infer.engine.grammar_process", "GrammarProcess", "publish"),
    ("infer.engine.engine_core", "EngineCore", "_finish"),
    ("infer.engine.engine_core", "EngineCore", "_advance_grammars"),
    ("infer.transfer", "HostCopy", "wait"),
    ("infer.engine.scheduler", "Scheduler", "update"),
    ("infer.engine.output_processor", "OutputProcessor", "process"),
)


class LoopPhases:
    def __init__(self) -> None:
        self.label: object = None  # recording while not None
        self.calls: dict[object, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        for module, owner, name in PHASES:
            holder = importlib.import_module(module)
            if owner is not None:
                holder = getattr(holder, owner)
            self._wrap(holder, name, f"{owner + '.' if owner else ''}{name}")

    def _wrap(self, holder: object, name: str, phase: str) -> None:
        def record(seconds: float, _args: tuple) -> None:
            if self.label is not None:
                self.calls[self.label][phase].append(seconds)

        wrap_timed(holder, name, record)

    def table(self) -> list[dict]:
        """Median µs a call of each phase by label (and calls), printed and returned."""
        labels = list(self.calls)
        print("| phase | " + " | ".join(f"{label}: µs a call (calls)" for label in labels)
              + " |\n|---|" + "---:|" * len(labels))
        out = []
        for _, owner, name in PHASES:
            phase = f"{owner + '.' if owner else ''}{name}"
            cells = []
            for label in labels:
                times = self.calls[label].get(phase)
                if times:
                    us = statistics.median(times) * 1e6
                    out.append({"label": str(label), "phase": phase, "median_us": us,
                                "calls": len(times)})
                    cells.append(f"{us:,.0f} ({len(times)})")
                else:
                    cells.append("-")
            print(f"| {phase} | " + " | ".join(cells) + " |")
        return out
