"""The tree's layers: every import points downward.

    sits_app (CLI, stack, demo, fleet)           top: wires everything, imported by nothing below
    services.capture/decision/executor/validator never import each other
    sits_mesh, sits_engine, kernels              the mesh, the code inside vLLM, the GPU kernels
    sits.runtime, sits.v1                        bottom: the bus, settings, contract, stubs

Imports inside functions and under TYPE_CHECKING count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("sits", "sits_app", "sits_engine", "sits_mesh", "services", "kernels", "bench", "scenarios", "scripts", "tests")


def _layer(module: str) -> str:
    """The layer a dotted module name belongs to, e.g. `services.decision` or `sits.runtime`."""
    parts = module.removesuffix(".__init__").split(".")
    if parts[0] == "services" and len(parts) > 1:
        return ".".join(parts[:2])
    if parts[0] == "sits":
        return "sits.runtime" if len(parts) > 1 and parts[1] in ("runtime", "v1") else "sits"
    return parts[0]


# What each layer may import (besides itself and third-party packages).
ALLOWED: dict[str, set[str]] = {
    "sits.runtime": set(),
    "sits": {"sits.runtime"},
    "services": set(),
    "kernels": set(),
    "sits_engine": {"sits.runtime"},
    "sits_mesh": {"sits.runtime"},
    **{
        f"services.{name}": {"sits.runtime", "sits_engine", "sits_mesh"}
        for name in ("capture", "decision", "executor", "validator")
    },
}


def _imports(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in OURS]


def _sources() -> list[Path]:
    roots = ["sits", "sits_engine", "sits_mesh", "services", "kernels"]
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if "_pb2" not in p.name)


def _own_layer(path: Path) -> str:
    return _layer(".".join(path.relative_to(REPO).with_suffix("").parts))


def test_the_layers_cover_the_product() -> None:
    layers = {_own_layer(p) for p in _sources()}
    assert layers <= set(ALLOWED), f"a package with no layer: {layers - set(ALLOWED)}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_downward(path: Path) -> None:
    own = _own_layer(path)
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for line, name in _imports(path)
        if _layer(name) != own and _layer(name) not in ALLOWED[own]
    ]
    assert not wrong, "\n".join(wrong)
