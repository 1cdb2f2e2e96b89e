"""Imports only go down: compat <- numerics <- precision <- model <- snip <- training <- arguments <- interop
<- cli (the entry points and tools); the lab (snip_lab/) sits beside the product and reads it, never the
other way round; and no module of either package takes part in an import cycle.

Every ``import`` in the package counts, including the ones inside functions (a lazy import that
goes up is still a cycle in the design). A package may import its own modules and any lower layer;
packages on the same layer do not import each other. The package map, docs/architecture.md,
lists every module and tool by path (checked here too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

# Lower number = lower layer. Every top-level module or package of megatron_snip must be listed.
LAYERS = {
    "fileio": 0, "flags": 0, "compat": 0,  # leaves: atomic files, config plumbing, the device
    "numerics": 1, "data": 1,              # formats, quantizers, quantized GEMM (no megatron-core); datasets
    "precision": 2,                        # plans, precision flags, FLOPs and GEMM-speed cost models
    "model": 3,                            # the Llama model, its quantized layers and precision controller, the step
    "snip": 4,                             # probes, estimators, ILP, the re-planner
    "training": 5,                         # the trainer and its run configuration
    "arguments": 6,                        # the command line -> RunConfig (the edge)
    "interop": 7,                          # Hugging Face conversion
    "cli": 8,                              # pretrain_llama.py's main and the tools' mains
}
PACKAGE = ROOT / "megatron_snip"
LAB = ROOT / "snip_lab"  # the research harness: policy comparisons, ablations, the oracle, estimator screens


def imports_of(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, top-level megatron_snip module) of every import in ``path``, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's own package
                out.append((node.lineno, path.relative_to(package).parts[0]))
            elif node.module and node.module.startswith("megatron_snip."):
                out.append((node.lineno, node.module.split(".")[1]))
            elif node.module == "megatron_snip":
                out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("megatron_snip.")]
    return out


def imported_modules(path: Path, root: Path) -> set[str]:
    """The dotted name of every import in ``path`` (a module under ``root``), relative ones resolved against
    the file's package; for ``from X import y`` both ``X`` and ``X.y`` (``y`` may be a module or a name)."""
    package = path.relative_to(root).parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` (directories under ``root``) it imports, anywhere in its code."""
    files = {p: ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
             for package in packages for p in (root / package).rglob("*.py")}
    modules = set(files.values())
    return {name: {t for t in imported_modules(path, root) if t in modules and t != name}
            for path, name in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each an import cycle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def layer_violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts == ("__init__",):
            continue
        me = parts[0]
        for line, other in imports_of(path, package):
            if other == me:
                continue
            if LAYERS[other] >= LAYERS[me]:
                bad.append(f"megatron_snip/{path.relative_to(package)}:{line}: {me} (layer {LAYERS[me]}) imports "
                           f"{other} (layer {LAYERS[other]})")
    return bad


def test_every_module_has_a_layer():
    names = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert names == set(LAYERS), f"unlisted: {names - set(LAYERS)}; gone: {set(LAYERS) - names}"


def test_imports_only_go_down():
    assert layer_violations() == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The guard itself: a lazy upward import inside a function is reported."""
    fake = tmp_path / "megatron_snip"
    (fake / "snip").mkdir(parents=True)
    (fake / "training").mkdir()
    (fake / "snip" / "passes.py").write_text("def f():\n    from megatron_snip.training.trainer import forward_step\n")
    (fake / "training" / "trainer.py").write_text("from megatron_snip.snip import passes\n")
    assert layer_violations(fake) == ["megatron_snip/snip/passes.py:2: snip (layer 4) imports training (layer 5)"]


def test_the_product_never_imports_the_lab():
    """megatron_snip/ runs without snip_lab/: not one import of it, lazy ones included."""
    bad = [f"{path.relative_to(ROOT)}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
           for name in sorted(imported_modules(path, ROOT)) if name.split(".")[0] == LAB.name]
    assert bad == []


def test_no_import_cycles_in_the_product_or_the_lab():
    """No module reaches itself through imports (lazy ones count: they only hide a cycle)."""
    assert import_cycles(import_graph(ROOT, (PACKAGE.name, LAB.name))) == []


def test_the_cycle_check_sees_a_cycle_closed_by_a_lazy_import(tmp_path):
    """The guard itself: a -> b at the top, b -> a inside a function; relative imports resolved."""
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "a.py").write_text("from .b import f\n")
    (tmp_path / "lab" / "b.py").write_text("def f():\n    from lab.a import g\n")
    (tmp_path / "lab" / "c.py").write_text("from lab import a\n")
    graph = import_graph(tmp_path, ("lab",))
    assert graph["lab.c"] == {"lab.a"} and import_cycles(graph) == [["lab.a", "lab.b"]]


ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAPPED_DIRS = ("megatron_snip", "snip_lab", "tools", "bench", "examples", "scripts")
_PATH = re.compile(r"`((?:{})/[\w./-]+|pretrain_llama\.py)`".format("|".join(MAPPED_DIRS)))


def map_problems(text: str, root: Path = ROOT) -> list[str]:
    """What the package map (docs/architecture.md) gets wrong about the tree under ``root``: a module of
    megatron_snip/ or snip_lab/ or a tool in tools/ (tools/lab/ too) that it does not list by path, or a
    listed path that does not exist."""
    listed = set(_PATH.findall(text))
    required = {p.relative_to(root).as_posix() for package in ("megatron_snip", "snip_lab")
                for p in (root / package).rglob("*.py") if p.name != "__init__.py"}
    required |= {p.relative_to(root).as_posix() for p in (root / "tools").rglob("*.py")}
    return ([f"unlisted: {p}" for p in sorted(required - listed)]
            + [f"listed but missing: {p}" for p in sorted(listed) if not (root / p).exists()])


def test_architecture_map_lists_every_module_and_tool():
    """docs/architecture.md is the map of the tree: every module and tool is on it by path, and every
    path on it exists."""
    assert map_problems(ARCHITECTURE.read_text()) == []


def test_the_map_check_sees_an_unlisted_and_a_gone_module(tmp_path):
    (tmp_path / "megatron_snip" / "snip").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    (tmp_path / "megatron_snip" / "snip" / "planner.py").touch()
    (tmp_path / "megatron_snip" / "snip" / "config.py").touch()
    (tmp_path / "tools" / "snip_solve.py").touch()
    text = ("| `megatron_snip/snip/planner.py` | plans |\n| `megatron_snip/snip/gone.py` | removed |\n"
            "| `tools/snip_solve.py` | offline |\n")
    assert map_problems(text, tmp_path) == ["unlisted: megatron_snip/snip/config.py",
                                            "listed but missing: megatron_snip/snip/gone.py"]


def test_numerics_stands_alone():
    """numerics/ imports no megatron-core (so it can be used alone, like torchao's mx_formats), and of this
    package only the device helper."""
    bad = []
    for path in sorted((PACKAGE / "numerics").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.name}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] == "megatron" or (n.startswith("megatron_snip.")
                                                         and n.split(".")[1] not in ("numerics", "compat"))]
    assert bad == []
