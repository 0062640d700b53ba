"""FlashLoad's imports point one way (layout.md, "FlashLoad as one pipeline over sources"):
lifecycle -> pipeline -> prepared -> choose -> sources/* -> {client, stream, shm, landing} -> {want, report}.

Read from the source (every ``import``, at module level or inside a function), so a lazy import
that closes a circle is caught as well as a module-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flashboot.flashload

ROOT = Path(flashboot.flashload.__file__).parent

LAYER = {
    "lifecycle": 7, "restart": 7,
    "pipeline": 6, "prepared": 6,
    "choose": 5,
    "sources": 4, "sources.served": 4, "sources.pinned": 4, "sources.disk": 4, "sources.base": 4,
    "client": 3, "stream": 3, "landing": 3, "service": 3,
    "want": 2, "report": 2,
    "stage": 1, "shm": 1, "views": 1, "protocol": 1, "staging": 1,
}
"""Higher imports lower (one layer's modules may import each other: the cycle test covers them).
The preloader daemon's modules (server, service, staging) keep their own
order; they are listed where the load path reaches them."""

UPWARD_ALLOWED = {
    ("report", "lifecycle"): "LoadedImage.sleep/wake/close hand the call to the lifecycle (public methods)",
    ("pipeline", "restart"): "load(holder=...) hands the call to the restart path, which wraps load itself",
    ("prepared", "pipeline"): "PreparedLoad.load() is flashboot.load(..., prepared=handle)",
}


def _imports(path: Path, module: str) -> set[str]:
    """The flashload modules that ``path`` (module ``module``) imports, anywhere in it."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            prefix = "flashboot.flashload."
            if node.module and node.module.startswith(prefix):
                found.add(node.module[len(prefix):])
            continue
        if node.level - 1 > len(package):
            continue  # above flashload (flashboot.arena, flashboot.errors...)
        base = package[:len(package) - (node.level - 1)]
        if node.module:
            target = ".".join(base + node.module.split("."))
            found.add(target)
            for alias in node.names:  # ``from .sources import disk``: the submodule
                if (ROOT / Path(*target.split("."), alias.name + ".py")).exists():
                    found.add(f"{target}.{alias.name}")
        else:
            found.update(".".join(base + [alias.name]) for alias in node.names)
    return {m for m in found if m}


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module:
            graph[module] = _imports(path, module)
    return graph


def test_the_graph_reader_sees_lazy_and_relative_imports():
    graph = _graph()
    assert "client" in graph["sources.served"]  # a lazy ``from ..client import ...`` inside a function
    assert {"sources.disk", "sources.served", "sources.pinned"} <= graph["sources"]  # ``from . import disk``
    assert "landing" in graph["lifecycle"]


def test_load_path_imports_point_one_way():
    graph = _graph()
    upward = []
    for module, targets in graph.items():
        if module not in LAYER:
            continue
        for target in targets:
            if target in LAYER and LAYER[target] > LAYER[module] and (module, target) not in UPWARD_ALLOWED:
                upward.append(f"{module} -> {target}")
    assert not upward, f"imports against the layering: {sorted(upward)}"


def test_sources_import_neither_each_other_nor_choose():
    graph = _graph()
    sources = {m for m in graph if m.startswith("sources.")} - {"sources.base"}
    assert sources == {"sources.served", "sources.pinned", "sources.disk"}
    for module in sources:
        assert not (graph[module] & (sources | {"sources", "choose", "pipeline"})), module


def test_no_import_cycle_in_flashload_but_the_named_hand_overs():
    graph = {m: {t for t in ts if (m, t) not in UPWARD_ALLOWED} for m, ts in _graph().items()}
    done: set[str] = set()

    def cycle_from(module: str, stack: list[str]) -> list[str] | None:
        if module in stack:
            return stack[stack.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            found = cycle_from(target, stack + [module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = cycle_from(module, [])
        assert not found, " -> ".join(found)


def test_a_load_and_its_close_import_nothing_of_flashclone(tmp_path):
    """An engine that loads and closes (a swap, a restart) does not pay FlashClone's import
    (26-78 ms in a fresh process); only a refit, which holds the trainer's mappings, needs it."""
    from _preload_helpers import make_tiny_image
    from _python import run_python

    image = make_tiny_image(tmp_path)
    code = (f"import sys, flashboot\nli = flashboot.load({str(image)!r}, 0, 'cpu', timeout_s=30)\n"
            "assert li.tensors\nli.close()\n"
            "print(sorted(m for m in sys.modules if m.startswith('flashboot.flashclone')))")
    assert run_python("-c", code).strip() == "[]"


DAEMON_MODULES = {"server", "serve_copy"}
"""The preload daemon's own modules: its process imports CuPy once for its copies and verifies."""


def test_the_engine_side_of_flashload_never_imports_cupy():
    """An engine's load (served, pinned here, streamed), its early call and its sleep and wake copy
    through the driver's streams and events (flashboot.cuda_streams): importing CuPy in the engine
    cost 108-167 ms with the GIL held (issue 19), inside its first load. Only the daemon's modules
    may import it. Read from the source, lazy imports included."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module in DAEMON_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "cupy"]
    assert not offenders, offenders
