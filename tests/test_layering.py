"""The layering, read from the imports of the source (parsed, not imported): kernels take
tensors only and import nothing else of infer; the pure-Python core imports no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "infer"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, at any depth (function bodies
    included); relative imports are resolved against the file's package."""
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[:len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names.add(base)
            # `from infer import kernels` names a module too
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _files(*parts: str) -> list[Path]:
    target = SRC.joinpath(*parts)
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("path", _files("kernels"), ids=lambda p: p.name)
def test_kernels_import_nothing_else_of_infer(path: Path) -> None:
    outside = {n for n in imported_modules(path)
               if _in(n, "infer") and not _in(n, "infer.kernels")
               and n != "infer"}  # `from infer import kernels` leaves the bare package
    assert not outside, f"{path.relative_to(SRC)} imports {sorted(outside)}"


@pytest.mark.parametrize("path", [*_files("cache"), *_files("engine", "scheduler.py"),
                                  *_files("engine", "request.py")], ids=lambda p: p.name)
def test_pure_python_core_imports_no_torch(path: Path) -> None:
    torch_names = {n for n in imported_modules(path) if _in(n, "torch")}
    assert not torch_names, f"{path.relative_to(SRC)} imports {sorted(torch_names)}"


def test_the_parser_sees_imports() -> None:
    """Guard against a vacuous pass: the parser finds what it must."""
    assert "triton" in imported_modules(SRC / "kernels" / "rmsnorm.py")
    assert "infer.kernels.activation" in imported_modules(SRC / "kernels" / "paged_attention.py")
    assert "infer.attention.metadata" in imported_modules(SRC / "attention" / "torch_backend.py")
    assert _files("cache")
