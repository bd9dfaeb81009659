"""A tensor-parallel server whose rank 1 is killed mid-stream: what its clients get, whether
it exits, and what it leaves behind (processes, GPU memory).

Starts `infer serve CKPT --tensor-parallel-size N` (random weights in a shape of
benchmarks/configs, default llama-3.2-1b; `--tiny` for a CPU check over gloo) in a process
session of its own, waits for /health, opens `--streams` streaming completions of 1,000
forced tokens, and once every stream has its first chunk kills rank 1 (SIGKILL; on GPUs the
process nvidia-smi shows on GPU 1, which must be the `infer-tp-rank1` worker: both are
checked). Then, each with a deadline:

- every stream ends, each with an error event or a closed connection, none with
  finish_reason "length" (the 1,000 tokens cannot have been made);
- /health answers 503 or the server is already gone;
- the server process exits, non-zero (the server stops when its core dies);
- no process of the server's tree is left (all of them, read from /proc before the kill);
- on GPUs, no compute process on any GPU but those there before the server started (this
  script's own: it writes the checkpoint from the GPU), and each GPU's used memory back to
  what it was before the server started (within 256 MiB; nvidia-smi's per-GPU figure).

    PYTHONPATH=src python benchmarks/tp_kill.py               # the device run, N = 2
    PYTHONPATH=src python benchmarks/tp_kill.py --tiny        # the same on this CPU

Prints each check and writes benchmarks/results/tp_kill_<device>.json; exits 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

MEMORY_SLACK_MIB = 256
FORCED_TOKENS = 1000


# -- processes --------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of every process under `root`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(stat[1])
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = ppid
                todo.append(pid)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rank1_by_tree(server: int, tree: dict[int, int]) -> int | None:
    """The spawned process whose parent is a spawned child of the server: rank 1 is started
    by the core process, which the server started (the API processes start nothing)."""
    spawned = {p for p in tree if "spawn_main" in cmdline(p)}
    found = [p for p in spawned if tree[p] in spawned and tree[tree[p]] == server]
    return found[0] if len(found) == 1 else None


# -- GPUs -------------------------------------------------------------------------------
def nvidia_smi(query: str, kind: str = "gpu") -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_used_mib() -> list[int]:
    return [int(row[1]) for row in nvidia_smi("index,memory.used")]


def gpu_processes() -> list[dict[str, Any]]:
    """Compute processes and the GPU (index) each is on."""
    index = {row[1]: int(row[0]) for row in nvidia_smi("index,uuid")}
    rows = nvidia_smi("pid,gpu_uuid,used_memory", "compute-apps")
    return [dict(pid=int(r[0]), gpu=index.get(r[1]), used_mib=int(r[2])) for r in rows]


# -- HTTP -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None


def stream(port: int, model: str, record: dict, first: threading.Event) -> None:
    """One streaming completion; what arrived goes into `record`."""
    body = json.dumps({"model": model, "prompt": [11, 12, 13, 14], "stream": True,
                       "max_tokens": FORCED_TOKENS, "min_tokens": FORCED_TOKENS,
                       "ignore_eos": True})
    record.update(chunks=0, errors=[], finish=None, closed=False)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        record["status"] = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record["errors"].append(event["error"])
                continue
            record["chunks"] += 1
            first.set()
            for choice in event.get("choices", []):
                record["finish"] = choice.get("finish_reason") or record["finish"]
        record["closed"] = True
    except Exception as exc:  # a connection the server dropped counts as an ending
        record["closed"] = True
        record["exception"] = f"{type(exc).__name__}: {exc}"
    finally:
        first.set()


def wait_for(predicate, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# -- the run ------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--model", default="llama-3.2-1b", help="a shape of benchmarks/configs")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args()
    flags = common.parse_engine_flags(args.engine)
    on_gpu = not args.tiny and common.device().type == "cuda"
    path = common.get_checkpoint(args.model, args.tiny, args.ckpt_root)
    common.free_memory()
    res: dict[str, Any] = dict(model=args.model, tp=args.tp, checks={})
    checks: dict[str, bool] = res["checks"]

    def check(name: str, ok: bool, detail: Any = "") -> None:
        checks[name] = bool(ok)
        print(f"[{'ok' if ok else 'FAILED'}] {name}" + (f": {detail}" if detail != "" else ""),
              flush=True)

    if on_gpu:
        res["gpu_used_mib_before"] = gpu_used_mib()
        res["gpu_processes_before"] = gpu_processes()
    port = free_port()
    cmd = [sys.executable, "-m", "infer.cli", "serve", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tp", "--tensor-parallel-size",
           str(args.tp), "--max-model-len", str(FORCED_TOKENS + 64)]
    if args.tiny:
        cmd += ["--device", "cpu"]
    cmd += common.cli_flags(flags)
    log_path = common.results_path("tp_kill", args).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ})
    try:
        up = wait_for(lambda: health(port) == 200 or server.poll() is not None,
                      args.start_timeout, 1.0) and server.poll() is None
        check("server started", up, f"{time.monotonic() - t0:.0f} s")
        if not up:
            raise SystemExit(f"the server did not start; see {log_path}")
        tree = descendants(server.pid)
        res["tree"] = {str(p): dict(parent=pp, cmd=cmdline(p)[:120]) for p, pp in tree.items()}
        victim = rank1_by_tree(server.pid, tree)
        if on_gpu:
            on_gpu1 = [p["pid"] for p in gpu_processes() if p["gpu"] == 1]
            res["gpu1_pids"] = on_gpu1
            check("the process on GPU 1 is the tree's rank 1", on_gpu1 == [victim],
                  f"GPU 1: {on_gpu1}, tree: {victim}")
        check("rank 1 found", victim is not None, victim)
        if victim is None:
            raise SystemExit("no rank 1 to kill")

        records = [dict() for _ in range(args.streams)]
        firsts = [threading.Event() for _ in records]
        threads = [threading.Thread(target=stream, args=(port, "tp", r, f), daemon=True)
                   for r, f in zip(records, firsts)]
        for t in threads:
            t.start()
        for f in firsts:
            f.wait(120)
        res["chunks_before_kill"] = [r.get("chunks") for r in records]
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        for t in threads:
            t.join(120)
        res["streams"] = records
        ended = all(not t.is_alive() for t in threads)
        check("every stream ended", ended,
              f"{time.monotonic() - t_kill:.1f} s after the kill")
        check("every stream got an error event or a closed connection, none finished",
              all((r["errors"] or r.get("exception")) and r["finish"] != "length"
                  for r in records),
              [dict(chunks=r["chunks"], errors=[e.get("message", e) if isinstance(e, dict)
                                                else e for e in r["errors"]][:1],
                    exception=r.get("exception"), finish=r["finish"]) for r in records])
        code = health(port)
        check("/health answers 503 or the server is gone", code in (503, None), code)
        exited = wait_for(lambda: server.poll() is not None, 60)
        check("the server exited, non-zero", exited and server.returncode != 0,
              f"code {server.returncode}, {time.monotonic() - t_kill:.1f} s after the kill")
        gone = wait_for(lambda: not any(running(p) for p in tree), 60)
        left = [p for p in tree if running(p)]
        check("no process of the server's tree is left", gone, left or "")
        if on_gpu:
            ours = {p["pid"] for p in res["gpu_processes_before"]}  # this script's own

            def theirs() -> list[dict[str, Any]]:
                return [p for p in gpu_processes() if p["pid"] not in ours]

            wait_for(lambda: not theirs(), 30)
            procs, used = theirs(), gpu_used_mib()
            res.update(gpu_processes_after=gpu_processes(), gpu_used_mib_after=used)
            check("no compute process of the server's on any GPU", not procs, procs or "")
            check("each GPU's used memory back to its start (within "
                  f"{MEMORY_SLACK_MIB} MiB)",
                  all(a - b <= MEMORY_SLACK_MIB
                      for a, b in zip(used, res["gpu_used_mib_before"])),
                  f"before {res['gpu_used_mib_before']} MiB, after {used} MiB")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        res["server_log_tail"] = log_path.read_text()[-4000:]
        out = common.write_results("tp_kill", args, res)
        print(f"wrote {out}; server log {log_path}")
    if not all(checks.values()):
        print("--- server log (tail) ---\n" + res["server_log_tail"])
        sys.exit(1)


if __name__ == "__main__":
    main()
