"""Where `infer serve --pin-core` puts the engine core: CPU lists read as the kernel writes
them, hyperthreads kept together, the last physical core for the core and the rest for
everyone else, and every thread of a process moved (tested in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infer import cli
from infer.engine import cpu_affinity
from infer.engine.cpu_affinity import parse_cpu_list, physical_cores, split_for_core


@pytest.mark.parametrize(("text", "expected"), [
    ("0", {0}), ("0-3\n", {0, 1, 2, 3}), ("0,8", {0, 8}), ("0-1,8-9,12", {0, 1, 8, 9, 12}),
    ("", set())])
def test_cpu_lists_read_as_the_kernel_writes_them(text, expected):
    assert parse_cpu_list(text) == expected


def _topology(tmp_path: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_hyperthreads_of_one_core_stay_together(tmp_path, monkeypatch):
    # 4 cores x 2 threads, numbered as Linux does on x86: cpu i and i + 4 share a core.
    sys_cpu = _topology(tmp_path, {i: f"{i % 4},{i % 4 + 4}" for i in range(8)})
    monkeypatch.setattr(cpu_affinity, "_SYS_CPU", sys_cpu)
    assert physical_cores(set(range(8))) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert split_for_core(set(range(8))) == ({3, 7}, {0, 1, 2, 4, 5, 6})
    # Within what this process may use: a sibling outside it is not handed out.
    assert physical_cores({0, 1, 2, 3, 4}) == [{0, 4}, {1}, {2}, {3}]
    assert split_for_core({0, 1, 2, 3, 4}) == ({3}, {0, 1, 2, 4})
    assert split_for_core({0, 1, 2, 4, 5, 6}) is None  # 3 physical cores: none to spare


def test_without_topology_each_cpu_is_its_own_core(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_affinity, "_SYS_CPU", tmp_path)
    assert physical_cores({5, 1, 3}) == [{1}, {3}, {5}]
    assert split_for_core({0, 1, 2, 3}) == ({3}, {0, 1, 2})


@pytest.mark.parametrize(("argv", "pinned"), [
    (["--device", "cuda"], True), (["--device", "cpu"], False),
    (["--device", "cuda", "--no-pin-core"], False), (["--device", "cpu", "--pin-core"], True),
    (["--device", "cuda", "--no-core-process"], False)])
def test_the_server_pins_its_core_on_a_gpu_unless_told(monkeypatch, argv, pinned):
    monkeypatch.setattr(cpu_affinity, "_SYS_CPU", Path("/nonexistent"))
    monkeypatch.setattr(cli, "allowed_cpus", lambda: set(range(16)))
    args = cli.build_parser().parse_args(["serve", *argv])
    cli.serve_engine_config(args)
    split = cli.core_cpu_split(args)
    assert split == (({15}, set(range(15))) if pinned else None)


def test_pinning_needs_the_core_process(monkeypatch):
    args = cli.build_parser().parse_args(["serve", "--pin-core", "--no-core-process"])
    cli.serve_engine_config(args)
    with pytest.raises(ValueError, match="own process"):
        cli.core_cpu_split(args)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_every_thread_of_a_process_is_moved(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os, threading
        from infer.engine.cpu_affinity import pin_this_process
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        pin_this_process({{{cpu}}})
        after = threading.Thread(target=stop.wait)
        after.start()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print(len(tids), all(os.sched_getaffinity(t) == {{{cpu}}} for t in tids))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["3", "True"]
