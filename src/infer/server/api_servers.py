"""More than one API server process over one engine core (`infer serve --api-server-count N`).

One process's event loop tops out at some tens of thousands of streamed tokens per second
(HTTP, JSON, SSE, detokenizing: docs/performance.md). With N > 1 the server's own process
binds the port, starts the core with N request sides (`CoreClient.spawn_shared`), and
starts N - 1 further API processes that serve the same listening socket, each with its
own tokenizer, output processor and event loop over its own pipe to the core. The kernel
hands each new connection to one of the processes.

Lifetimes: the core stops when the first process's pipe closes (it exits, or is killed);
the others then see their pipe end and exit (and each watches its parent: orphaned, it
stops serving, and exits outright after ORPHAN_EXIT_S if that did not end it). If a
further process dies, the first stops the whole server (exit code 1), as when the core
dies. `/metrics` and `/stats` count the requests of the process that answers; the
engine's gauges are the core's, the same in all.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType

from infer.process_exit import exit_code_unreaped

log = logging.getLogger(__name__)
ORPHAN_EXIT_S = 5.0  # an orphaned API process's grace to stop by itself


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening, for every API process to accept on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_server(args: argparse.Namespace, conn: Connection, sock: socket.socket,
                   ready: EventType, serve: EventType, parent: int) -> None:
    """A further API process (`parent`: the pid of the server's first process): the same
    app over its own side of the core. It accepts connections once `serve` is set (every
    process of the server is ready then), and exits without serving if the core goes
    first."""
    from infer.cli import engine_config, serve_app, uvicorn_server
    from infer.engine.setup import freeze_startup_objects
    from infer.server import AsyncEngine, attach_engine

    app = serve_app(args)
    server = uvicorn_server(app, args)
    threading.Thread(target=_exit_when_orphaned, args=(parent, server),
                     name="infer-orphan-watch", daemon=True).start()
    engine = AsyncEngine.attach(engine_config(args), conn)
    engine.on_core_death = lambda: setattr(server, "should_exit", True)
    if not engine.alive:  # the core went before the line above could hear of it
        server.should_exit = True
    freeze_startup_objects()
    attach_engine(app, engine)
    ready.set()
    try:
        # The first process may die (and so the core) before it says serve.
        while not serve.wait(0.1):
            if not engine.alive:
                return
        server.run(sockets=[sock])
    finally:
        engine.shutdown()


def _exit_when_orphaned(parent: int, server: object) -> None:
    """A further API process must not outlive the server's first process, however that
    one ends (a SIGKILL runs none of its cleanup): once its parent is gone, stop serving,
    and exit outright if that has not ended the process within ORPHAN_EXIT_S."""
    while os.getppid() == parent:
        time.sleep(0.5)
    log.warning("the server's first process is gone; this API process stops")
    server.should_exit = True
    time.sleep(ORPHAN_EXIT_S)
    os._exit(1)


class ApiServers:
    """The further API processes of a server, started and waited for until each is ready;
    they accept connections after `serve()`. Then watched: `on_death` is called (once,
    from a watcher thread) when one of them exits while the server runs."""

    def __init__(self, args: argparse.Namespace, sides: list[Connection], sock: socket.socket,
                 on_death: Callable[[], None], timeout: float = 300.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        readies = [ctx.Event() for _ in sides]
        self._serve = ctx.Event()
        self.processes = [ctx.Process(target=run_api_server,
                                      args=(args, conn, sock, ready, self._serve,
                                            os.getpid()),
                                      name=f"infer-api-{i + 1}")
                          for i, (conn, ready) in enumerate(zip(sides, readies))]
        for process, conn in zip(self.processes, sides):
            process.start()
            conn.close()  # the child holds it now: its exit is the core's EOF
        self._stopping = threading.Event()
        for process, ready in zip(self.processes, readies):
            while not ready.wait(0.1):
                if not process.is_alive() or (timeout := timeout - 0.1) <= 0:
                    self.stop()
                    raise RuntimeError(f"API server process {process.name} did not start "
                                       f"(exit code {process.exitcode})")
        self._on_death = on_death
        threading.Thread(target=self._watch, name="infer-api-watch", daemon=True).start()

    def serve(self) -> None:
        self._serve.set()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        if not self._stopping.is_set():
            dead = sentinels[ready[0]]
            log.error("API server process %s exited (code %s); stopping the server",
                      dead.name, exit_code_unreaped(dead))
            self._on_death()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a graceful uvicorn exit), then SIGKILL for any that lingers."""
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
