"""docs/design.md's import graph: rgc's modules import one another without a cycle (imports
inside functions counted too), and the leaves import nothing of rgc."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LEAVES = ("rgc.registry", "rgc.seeding")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    base = SRC / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    """Module -> the rgc modules it imports anywhere in its source (``from rgc import ops``
    is an import of ``rgc.ops``; the root package ``rgc``, which re-exports, is left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((SRC / "rgc").rglob("*.py")):
        me, edges = _module(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rgc"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if _exists(full) else node.module)
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("rgc")}
        graph[me] = {e for e in edges if e not in ("rgc", me) and not me.startswith(e + ".")}
    return graph


def test_no_import_cycle():
    graph = import_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in graph:
        visit(node, [])
    assert len(graph) > 30  # the walk saw the package


def test_leaves_import_nothing_of_rgc():
    graph = import_graph()
    for leaf in LEAVES:
        assert graph[leaf] == set(), (leaf, graph[leaf])
    assert graph["rgc.bits"] == {"rgc.seeding"}  # the bit convention stands on seeds only


@pytest.mark.slow
def test_import_rgc_leaves_torch_distributed_tensor_unloaded():
    """``import rgc`` loads neither rgc.distributed nor torch.distributed's tensor package
    (about 0.8 s of every fresh process); ``rgc.DistributedRowAdam`` loads them on use."""
    code = ("import sys, rgc\n"
            "print(sorted(m for m in ('rgc.distributed', 'torch.distributed.tensor')"
            " if m in sys.modules))\n"
            "print(rgc.DistributedRowAdam.__module__, 'torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(SRC)}).stdout
    assert out.split("\n")[:2] == ["[]", "rgc.distributed True"], out
