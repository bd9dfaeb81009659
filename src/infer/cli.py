"""The command line: `infer serve | generate | chat | bench` (`infer COMMAND --help`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from infer.bench.cli import add_bench_command
from infer.distributed.torchrun import run_torchrun_worker, torchrun_rank
from infer.engine.batch_defaults import CPU_DEFAULTS
from infer.engine.config import EngineConfig
from infer.flags import (
    add_engine_flags,
    add_model_argument,
    add_sampling_flags,
    engine_config,
    sampling_params,
)
from infer.version import version


def cmd_generate(args: argparse.Namespace) -> int:
    from infer.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_config(args)))
    params = sampling_params(args)
    if args.chat:
        prompt = llm.get_tokenizer().encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    printed = 0
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from infer.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_config(args)))
    tokenizer = llm.get_tokenizer()
    params = sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("infer chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        printed, text = 0, ""
        for out in llm.stream(tokenizer.encode_chat(messages), params):
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": text})
    return 0


# Measured on an H100 (docs/performance.md, "Serving vs offline"): a burst of 256 streams
# is served 1.5x faster with 256 sequences per batch than with 64, and starts sooner.
SERVE_GPU_MAX_NUM_SEQS = 256
# Prefill chunks of at most this many tokens a step: the pressure workload's ITL p99 stays
# within 3x its p50 (docs/performance.md); offline runs take 16,384 on a large GPU.
SERVE_MAX_NUM_BATCHED_TOKENS = 2048
# ... and with 4 API server processes its chunks carry one token each (5.7 with one
# process, whose event loop falls behind), at 89 % of the offline rate against 80 %.
SERVE_GPU_API_SERVERS = 4
CORES_PER_API_SERVER = 4  # the core and each API process want a core of their own


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags, with the server's batch size and API processes sized to the
    device when not given: a GPU batches many streams at little cost per step, and their
    tokens need more than one process to stream; a CPU keeps the engine's defaults."""
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and _has_cuda())
    if args.max_num_seqs is None:
        args.max_num_seqs = SERVE_GPU_MAX_NUM_SEQS if on_gpu else CPU_DEFAULTS[0]
        print(f"infer: max_num_seqs={args.max_num_seqs}, the server's default on a "
              f"{'GPU' if on_gpu else 'CPU'} (--max-num-seqs to change)", file=sys.stderr)
    if args.max_num_batched_tokens is None:  # small steps: streams keep their pace
        args.max_num_batched_tokens = SERVE_MAX_NUM_BATCHED_TOKENS
    if args.api_server_count is None:
        cores = os.cpu_count() or 1
        args.api_server_count = (max(1, min(SERVE_GPU_API_SERVERS,
                                            cores // CORES_PER_API_SERVER))
                                 if on_gpu and args.core_process else 1)
        if args.api_server_count > 1:
            print(f"infer: {args.api_server_count} API server processes, the server's "
                  f"default on a GPU with {cores} CPU cores (--api-server-count to change)",
                  file=sys.stderr)
    return engine_config(args)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def serve_app(args: argparse.Namespace):
    """The server's app, without an engine yet (/health is 503 until one is attached).
    Every API server process builds its own from the same args."""
    from infer.server import build_app

    limits = {} if args.max_seqs_per_request is None else {
        "max_seqs_per_request": args.max_seqs_per_request}
    return build_app(None, args.served_model_name, api_key=args.api_key,
                     request_timeout=args.request_timeout,
                     chat_template=load_chat_template(args.chat_template),
                     allowed_origins=_flat(args.allowed_origins),
                     allowed_methods=_flat(args.allowed_methods),
                     allowed_headers=_flat(args.allowed_headers),
                     allow_credentials=args.allow_credentials, **limits)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template, as vLLM takes it: a file's path, or the template itself (a value
    with no Jinja in it that names no readable file is a path that failed). ValueError
    for one that cannot be read or does not compile."""
    from infer.loader.chat_template import ChatTemplateError, compile_template

    if value is None:
        return None
    try:
        text = Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value}: the file is not UTF-8 text") from None
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value}: cannot read the file "
                             f"({exc.strerror or exc})") from None
        text = value
    try:
        compile_template(text)
    except ChatTemplateError as exc:
        shown = value if text is not value else "(the template given)"
        raise ValueError(f"--chat-template {shown}: {exc}") from None
    return text


def _cors_list(text: str) -> list[str]:
    """A value of --allowed-origins and co: one item, or a JSON list of them (vLLM's
    older form, `'["http://a", "http://b"]'`)."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text}")
    return items


def _flat(values: list[list[str]]) -> list[str]:
    return [item for items in values for item in items]


def uvicorn_server(app, args: argparse.Namespace):
    import uvicorn

    from infer.server.connections import limited_protocol

    # uvicorn's own limit_concurrency stays unset: it answers a plain-text 503 only once a
    # request head has arrived (never to a stalled client); our protocol refuses at accept.
    http = limited_protocol(args.request_read_timeout, args.max_connections)
    # lifespan off: the app has no startup or shutdown hooks (the engine loads in a thread),
    # and uvicorn's lifespan task would log a traceback on every Ctrl-C.
    return uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                         log_level=args.log_level, http=http,
                                         timeout_keep_alive=args.timeout_keep_alive,
                                         lifespan="off"))


def cmd_serve(args: argparse.Namespace) -> int:
    """Listen at once (/health is 503 while the model loads), then load and serve."""
    import threading

    from infer.engine.llm_engine import LLMEngine
    from infer.engine.setup import freeze_startup_objects
    from infer.server import AsyncEngine, attach_engine
    from infer.server.api_servers import ApiServers, listening_socket

    config = serve_engine_config(args)
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1 and not config.core_process:
        raise ValueError("--api-server-count above 1 needs the core in its own process "
                         "(drop --no-core-process)")
    app = serve_app(args)
    server = uvicorn_server(app, args)
    sock = listening_socket(args.host, args.port) if args.api_server_count > 1 else None
    failure: list[BaseException] = []
    died: list[str] = []
    others: list[ApiServers] = []

    def stop(what: str) -> None:
        died.append(what)
        server.should_exit = True

    def load() -> None:
        engine = None
        try:
            if sock is not None:
                engine, sides = AsyncEngine.launch_shared(config, args.api_server_count)
                engine.on_core_death = lambda: stop("the engine core")
                others.append(ApiServers(args, sides, sock,
                                         lambda: stop("an API server process")))
            elif config.core_process:
                engine = AsyncEngine.launch(config)
            else:
                engine = AsyncEngine.in_thread(LLMEngine(config))
            engine.on_core_death = lambda: stop("the engine core")
            freeze_startup_objects()
            attach_engine(app, engine)
            for group in others:  # they accept only now: none says "loading" after a 200
                group.serve()
            print(f"infer: serving on http://{args.host}:{args.port}"
                  + (f" ({args.api_server_count} API server processes)" if sock else ""),
                  file=sys.stderr)
        except BaseException as exc:
            failure.append(exc)
            server.should_exit = True
            if engine is not None and app.state.engine is None:
                engine.shutdown()

    threading.Thread(target=load, name="infer-load", daemon=True).start()
    try:
        server.run(sockets=[sock] if sock is not None else None)  # re-raises the signal
    finally:                                                      # that stopped it
        for group in others:
            group.stop()
        engine = app.state.engine
        if engine is not None:
            engine.shutdown()
    if failure:
        raise failure[0]
    if died:
        print(f"infer: {died[0]} died; the server stopped (in-flight requests got errors). "
              "Restart it, e.g. under a supervisor.", file=sys.stderr)
        return 1
    return 0


def _set_help(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    for action in parser._actions:
        if action.dest == dest:
            action.help = text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infer", description="An LLM inference and serving engine: an OpenAI-compatible "
        "server, one-shot generation, a terminal chat and benchmarks. `infer COMMAND --help` "
        "lists a command's flags.")
    parser.add_argument("--version", action="version", version=f"infer {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve MODEL (default: the embedded "
                           "SmolLM2-135M-Instruct) over the OpenAI API: /v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /metrics.")
    add_model_argument(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    server.add_argument("--api-key", default=os.environ.get("INFER_API_KEY"),
                        help="require `Authorization: Bearer KEY` (default: $INFER_API_KEY)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model's name)")
    server.add_argument("--max-seqs-per-request", type=int, default=None,
                        help="most sequences (prompts x n) one request may ask for; more "
                        "get 400 (default: 1024)")
    server.add_argument("--request-timeout", type=float, default=None,
                        help="seconds before a request is aborted with 504 (default: none)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default: 5)")
    server.add_argument("--request-read-timeout", type=float, default=30.0,
                        help="seconds a client has to send a whole request, head and body, "
                        "before the connection is closed (408) (default: 30)")
    server.add_argument("--max-connections", type=int, default=1024,
                        help="open connections beyond this get 503 (default: 1024)")
    server.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's log level (default: info)")
    server.add_argument("--chat-template", default=None,
                        help="a chat template (Jinja) for chat completions and /tokenize "
                        "with messages, in place of the model's: a file's path, or the "
                        "template itself (default: the model's)")
    for what in ("origins", "methods", "headers"):
        server.add_argument(f"--allowed-{what}", nargs="+", type=_cors_list,
                            default=[["*"]], metavar=what[:-1].upper(),
                            help=f"CORS: the allowed {what} (* for any); each a value "
                            "or a JSON list (default: *)")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies and Authorization headers "
                        "(default: off)")
    server.add_argument("--api-server-count", type=int, default=None,
                        help="API server processes (HTTP, tokenizing, detokenizing) sharing "
                        "the port and the one engine core; more stream more tokens at once "
                        f"(default: on a GPU, {SERVE_GPU_API_SERVERS} or one per "
                        f"{CORES_PER_API_SERVER} CPU cores if fewer; on a CPU, 1)")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve, max_num_seqs=None, core_process=True)
    _set_help(serve, "core_process", "run the engine core (scheduler, model, sampler) in its "
              "own process, apart from HTTP and detokenizing; --no-core-process runs it in a "
              "thread of the server (default: on)")
    _set_help(serve, "max_num_seqs", "most sequences in one batch (default: "
              f"{SERVE_GPU_MAX_NUM_SEQS} on a GPU, {CPU_DEFAULTS[0]} on a CPU)")
    _set_help(serve, "max_num_batched_tokens", "token budget per step (default: "
              f"{SERVE_MAX_NUM_BATCHED_TOKENS}: small steps keep the running streams' "
              "inter-token latency low while prompts arrive)")
    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout",
                         description="Complete PROMPT with the model of --model (default: "
                         "the embedded SmolLM2-135M-Instruct), streaming the text to stdout.")
    gen.add_argument("prompt", help="the text to complete")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    add_sampling_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat in the terminal",
                          description="Chat with MODEL (default: the embedded "
                          "SmolLM2-135M-Instruct) in the terminal; an empty line or Ctrl-D "
                          "quits.")
    add_model_argument(chat)
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_flags(chat)
    add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.func in (cmd_serve, cmd_generate, cmd_chat) and torchrun_rank():
            # A rank torchrun started, on this host or another: only its shard of the
            # engine runs here; rank 0 runs the command.
            run_torchrun_worker(engine_config(args))
            return 0
        return args.func(args)
    except (ValueError, KeyboardInterrupt) as exc:
        if isinstance(exc, ValueError):
            print(f"infer: error: {exc}", file=sys.stderr)
            return 2
        return 130


if __name__ == "__main__":
    sys.exit(main())
