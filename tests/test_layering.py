"""Imports only go down: compat <- precision <- model <- snip <- training <- entry points and tools.

Every ``import`` in the package counts, including the ones inside functions (a lazy import that
goes up is still a cycle in the design). A package may import its own modules and any lower layer;
packages on the same layer do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Lower number = lower layer. Every top-level module or package of megatron_snip must be listed.
LAYERS = {
    "fileio": 0, "flags": 0, "compat": 0,  # leaves: atomic files, config plumbing, the device
    "precision": 1, "data": 1,             # formats, quantizers, plans; tokenizers and datasets
    "model": 2,                            # the Llama model, its quantized layers, the step function
    "snip": 3,                             # probes, estimators, ILP, the re-planner
    "training": 4,                         # the trainer and its run configuration
    "arguments": 5,                        # the command line -> RunConfig (the edge)
    "interop": 6, "experiments": 6,        # Hugging Face conversion, precision comparisons (tool libraries)
    "cli": 7,                              # pretrain_llama.py's main
}
PACKAGE = ROOT / "megatron_snip"


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
    assert layer_violations(fake) == ["megatron_snip/snip/passes.py:2: snip (layer 3) imports training (layer 4)"]


def test_readme_layout_names_every_module_and_tool():
    """The README's layout section is the map of the tree: every module and tool is on it."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    modules = {p.name for p in PACKAGE.rglob("*.py")} - {"__init__.py"}
    tools = {p.stem for p in (ROOT / "tools").glob("*.py")}
    missing = sorted(m for m in modules if m not in layout) + sorted(t for t in tools if t not in layout)
    assert missing == [], f"README.md's Layout section lacks {missing}"
