"""The package's import graph: no cycles between modules, and no module imports a layer above (or beside) it.

Layers (``X <- Y``: Y may import X): batching.py, typed_config.py, processes.py, reporting.py, print_cap.py at the
bottom <- algorithms (pure torch) and models (model families) <- megatron (the Megatron-Core seam) <- conversion
(HF <-> Megatron tools built on the seam: offline DCP I/O, live export, the logits check) <- rollout,
data <- rewards (a generative judge decodes with the rollout engine) <- trainer <- testing <- smoke <- cli <- api (training from Python runs the command line's
entry). The one difference from the first design sketch
(``conversion <- megatron``) is deliberate: converting needs Megatron's models and sharding algebra, while
the seam needs from conversion only the Transformer Engine names, which live in megatron/te_names.py. Two
units of one layer are independent. Every import counts, also one inside a function (a lazy import is
still a dependency), and each offence is reported by file and line.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "gspo_megatron"

# unit (a subpackage or top-level module of the package) -> layer; "" is the package's own __init__
LAYERS: dict[str, int] = {
    "": 0, "typed_config": 0, "batching": 0, "processes": 0, "reporting": 0, "print_cap": 0,
    "algorithms": 1, "models": 1,
    "megatron": 2,
    "conversion": 3,
    "rollout": 4, "data": 4,
    "rewards": 5,  # the judge term (rewards/scoring_models.py) decodes with rollout's in-process engine
    "trainer": 6,
    "testing": 7,  # helpers for tests and the smoke command (gloo process runner, canonical models)
    "smoke": 8,
    "cli": 9,
    "api": 10,  # train() from Python: builds the command line's arguments and calls its entry
}

KNOWN_UPWARD: set[tuple[str, str]] = set()
# the same for cycles (sorted module names of each)
KNOWN_CYCLES: list[list[str]] = []


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str  # dotted module names
    imported: str
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``root/package`` (a package's name is its __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every import of a module of ``package`` by another, anywhere in a file (functions included).

    ``from a.b import c`` is an edge to module ``a.b.c`` when that is a module, else to ``a.b``; relative
    imports are resolved against the importing module."""
    modules = package_modules(root, package)
    edges = []
    for name, path in modules.items():
        is_init = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_init else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                while target and target not in modules and "." in target:  # import a.b.c where c is a name
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.append(Edge(name, target, path, node.lineno))
    return edges


def unit_of(module: str) -> str:
    """The layer unit of a dotted module name: its first component below the package ('' for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_offences(edges: list[Edge], layers: dict[str, int], root: Path) -> list[str]:
    """'file:line: a imports b (...)' for each import of a unit in a higher layer or a peer of the same layer;
    a unit missing from ``layers`` is an offence too, so a new package has to be placed."""
    offences = []
    for edge in edges:
        src, dst = unit_of(edge.importer), unit_of(edge.imported)
        if src == dst:
            continue
        missing = [u or PACKAGE for u in (src, dst) if u not in layers]
        if missing:
            offences.append(f"{edge.where(root)}: {', '.join(missing)} has no layer in LAYERS")
        elif layers[dst] > layers[src]:
            offences.append(f"{edge.where(root)}: {edge.importer} imports {edge.imported}, a layer above it "
                            f"({src}: {layers[src]} < {dst}: {layers[dst]})")
        elif layers[dst] == layers[src]:
            offences.append(f"{edge.where(root)}: {edge.importer} imports {edge.imported}, beside it in layer "
                            f"{layers[src]} ({src} and {dst} are independent)")
    return offences


def import_cycles(edges: list[Edge]) -> list[list[str]]:
    """The modules of each import cycle (strongly connected component with more than one module)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:  # Tarjan; the package has ~150 modules, so recursion depth is no concern
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _describe_cycles(cycles: list[list[str]], edges: list[Edge], root: Path) -> list[str]:
    lines = []
    for members in cycles:
        inside = [e for e in edges if e.importer in members and e.imported in members]
        lines.append("cycle: " + "; ".join(f"{e.where(root)} {e.importer} -> {e.imported}" for e in inside))
    return lines


# ---- the package --------------------------------------------------------------------------------------


def test_package_has_no_import_cycle():
    edges = import_edges(REPO, PACKAGE)
    assert len(edges) > 100  # the parser found the package's imports
    cycles = import_cycles(edges)
    assert _describe_cycles([c for c in cycles if c not in KNOWN_CYCLES], edges, REPO) == []
    assert [c for c in KNOWN_CYCLES if c not in cycles] == [], "fixed, remove from KNOWN_CYCLES"


def test_no_module_imports_a_layer_above_it():
    edges = import_edges(REPO, PACKAGE)
    known = [e for e in edges if (e.importer, e.imported) in KNOWN_UPWARD]
    offences = layering_offences([e for e in edges if (e.importer, e.imported) not in KNOWN_UPWARD], LAYERS, REPO)
    assert offences == []
    gone = KNOWN_UPWARD - {(e.importer, e.imported) for e in known}
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {sorted(gone)}"
    assert len(layering_offences(known, LAYERS, REPO)) == len(known)  # each listed import does break the rule


def test_every_unit_of_the_package_has_a_layer():
    units = {unit_of(m) for m in package_modules(REPO, PACKAGE)}
    assert units - set(LAYERS) == set()


def external_imports(root: Path, package: str, unit: str) -> dict[str, list[str]]:
    """Top-level names of the third-party or standard modules a unit imports -> 'file:line' of each import."""
    found: dict[str, list[str]] = {}
    for name, path in package_modules(root, package).items():
        if unit_of(name) != unit:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - {package}:
                found.setdefault(top, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_algorithms_is_pure_torch():
    """DESIGN: algorithms/ imports nothing from Megatron or SGLang (nor anything else heavy)."""
    found = external_imports(REPO, PACKAGE, "algorithms")
    assert "torch" in found  # the parser sees the imports
    assert {k: v for k, v in found.items() if k in ("megatron", "sglang", "transformer_engine", "apex", "transformers")} == {}


# ---- the checker on a synthetic package ---------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC_LAYERS = {"": 0, "algorithms": 1, "megatron": 2, "rollout": 3, "rewards": 3, "trainer": 4}


@pytest.fixture
def synthetic(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/algorithms/__init__.py": "",
        "pkg/algorithms/loss.py": "import torch\n",
        "pkg/megatron/__init__.py": "",
        "pkg/megatron/model.py": "from pkg.algorithms.loss import x\nfrom ..algorithms import loss\n",
        "pkg/rollout/__init__.py": "",
        "pkg/rewards/__init__.py": "",
        "pkg/trainer/__init__.py": "",
        "pkg/trainer/loop.py": "import pkg.megatron.model\nfrom pkg.rollout import engine\n",
    })
    return tmp_path


def test_external_imports_name_the_file_and_line(synthetic):
    _write(synthetic, {"pkg/algorithms/heavy.py": "import os\n\n\ndef f():\n    from megatron.core import parallel_state\n"})
    found = external_imports(synthetic, "pkg", "algorithms")
    assert found == {"torch": ["pkg/algorithms/loss.py:1"], "os": ["pkg/algorithms/heavy.py:1"],
                     "megatron": ["pkg/algorithms/heavy.py:5"]}


def test_checker_accepts_a_clean_tree(synthetic):
    edges = import_edges(synthetic, "pkg")
    assert {(e.importer, e.imported) for e in edges} == {
        ("pkg.megatron.model", "pkg.algorithms.loss"), ("pkg.trainer.loop", "pkg.megatron.model"),
        ("pkg.trainer.loop", "pkg.rollout")}
    assert layering_offences(edges, SYNTHETIC_LAYERS, synthetic) == []
    assert import_cycles(edges) == []


def test_checker_reports_an_upward_import_inside_a_function_by_file_and_line(synthetic):
    _write(synthetic, {"pkg/algorithms/bad.py": "import os\n\n\ndef f():\n    from pkg.trainer import loop\n"})
    offences = layering_offences(import_edges(synthetic, "pkg"), SYNTHETIC_LAYERS, synthetic)
    assert offences == ["pkg/algorithms/bad.py:5: pkg.algorithms.bad imports pkg.trainer.loop, a layer above it "
                        "(algorithms: 1 < trainer: 4)"]


def test_checker_reports_a_relative_import_of_a_peer(synthetic):
    _write(synthetic, {"pkg/rewards/score.py": "from ..rollout import engine\n"})
    offences = layering_offences(import_edges(synthetic, "pkg"), SYNTHETIC_LAYERS, synthetic)
    assert offences == ["pkg/rewards/score.py:1: pkg.rewards.score imports pkg.rollout, beside it in layer 3 "
                        "(rewards and rollout are independent)"]


def test_checker_reports_a_unit_without_a_layer(synthetic):
    _write(synthetic, {"pkg/extra.py": "from pkg.algorithms import loss\n"})
    offences = layering_offences(import_edges(synthetic, "pkg"), SYNTHETIC_LAYERS, synthetic)
    assert offences == ["pkg/extra.py:1: extra has no layer in LAYERS"]


def test_checker_finds_a_cycle_and_names_its_edges(synthetic):
    _write(synthetic, {"pkg/algorithms/a.py": "from pkg.algorithms import b\n",
                       "pkg/algorithms/b.py": "def f():\n    import pkg.algorithms.a\n"})
    edges = import_edges(synthetic, "pkg")
    assert import_cycles(edges) == [["pkg.algorithms.a", "pkg.algorithms.b"]]
    assert _describe_cycles(import_cycles(edges), edges, synthetic) == [
        "cycle: pkg/algorithms/a.py:1 pkg.algorithms.a -> pkg.algorithms.b; "
        "pkg/algorithms/b.py:2 pkg.algorithms.b -> pkg.algorithms.a"]
