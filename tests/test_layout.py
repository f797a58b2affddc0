"""The package layout is the architecture: these rules keep it true.

Layers (``LAYERS``), each a folder of ``hlofold``, and what each may import (``ALLOWED``):

* ``_compat`` (every use of JAX internals and MLIR bindings) imports nothing else of hlofold,
  and no other module reads ``jax._src`` or ``jaxlib``'s internals;
* ``_base`` (reasons, report, tolerance, algebra, channel bookkeeping) imports only itself;
* ``_ir.jaxpr`` / ``_ir.stablehlo`` (reading, building, evaluating each IR) import the base and
  ``_compat``: never each other, never a capability;
* ``_fold.core`` and ``_quant.core`` (each capability's IR-agnostic rules) import only the
  base — never an IR, an adapter or each other;
* a capability's adapter (``_fold.jaxpr`` …) imports the base, ``_compat``, its own IR and its
  capability's core; the quantization adapters may also read the folding core and the folding
  adapter of their own IR (rewrites run on folded programs), never the other way round;
  the jaxpr and StableHLO folders under one parent never import each other;
* ``_front`` (what users call) may import anything; nothing imports it but ``hlofold``.

Besides: no import cycle between modules (imports inside functions count); no module imports
another's private name (``from .x import _y``); ``docs/architecture.md``'s map names every
module of the tree and nothing else.

The imports are read from the source (``ast``), function-level imports included.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import hlofold

PKG = pathlib.Path(hlofold.__file__).parent
MODULES = sorted(PKG.rglob("*.py"))
ARCHITECTURE = PKG.parent / "docs" / "architecture.md"

LAYERS = ("_compat", "_base", "_ir.jaxpr", "_ir.stablehlo", "_fold.core", "_fold.jaxpr",
          "_fold.stablehlo", "_quant.core", "_quant.jaxpr", "_quant.stablehlo", "_front")
_IR_SIDE = {"_compat", "_base"}
ALLOWED = {
    "_compat": {"_compat"},
    "_base": {"_base"},
    "_ir.jaxpr": _IR_SIDE | {"_ir.jaxpr"},
    "_ir.stablehlo": _IR_SIDE | {"_ir.stablehlo"},
    "_fold.core": {"_base", "_fold.core"},
    "_quant.core": {"_base", "_quant.core"},
    "_fold.jaxpr": _IR_SIDE | {"_ir.jaxpr", "_fold.core", "_fold.jaxpr"},
    "_fold.stablehlo": _IR_SIDE | {"_ir.stablehlo", "_fold.core", "_fold.stablehlo"},
    "_quant.jaxpr": _IR_SIDE | {"_ir.jaxpr", "_fold.core", "_fold.jaxpr", "_quant.core",
                                "_quant.jaxpr"},
    "_quant.stablehlo": _IR_SIDE | {"_ir.stablehlo", "_fold.core", "_fold.stablehlo",
                                    "_quant.core", "_quant.stablehlo"},
}


def module_name(path: pathlib.Path) -> str:
    parts = ("hlofold",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {module_name(p) for p in MODULES}


def imports(path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every import of a hlofold module in ``path``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            if mod.startswith("hlofold"):
                # ``from . import blobs``: the names are modules
                subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in NAMES]
                out += [(s, [], node.lineno) for s in subs] if subs else \
                    [(mod, names, node.lineno)]
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names
                    if a.name.startswith("hlofold")]
    return out


def layer(mod: str) -> str | None:
    """The layer a module belongs to (None: ``hlofold`` itself, ``examples``, ``__main__``)."""
    for p in sorted(LAYERS, key=len, reverse=True):
        full = "hlofold." + p
        if mod == full or mod.startswith(full + "."):
            return p
    return None


def test_every_module_is_in_a_layer():
    loose = sorted(m for m in NAMES if layer(m) is None and m not in (
        "hlofold", "hlofold.examples", "hlofold.__main__", "hlofold._ir", "hlofold._fold",
        "hlofold._quant"))
    assert not loose, f"modules outside every layer: {loose}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_each_layer_imports_only_what_it_may(path):
    me = layer(module_name(path))
    if me is None or me == "_front":
        return                                   # the front ends may import anything
    bad = [f"line {line}: {mod}" for mod, _, line in imports(path)
           if mod != "hlofold" and layer(mod) not in ALLOWED[me]]
    assert not bad, f"{module_name(path)} ({me}) imports {bad}"


def test_no_layer_below_the_front_ends_imports_them():
    bad = [f"{module_name(p)} line {line}: {mod}" for p in MODULES
           if layer(module_name(p)) not in (None, "_front")
           for mod, _, line in imports(p) if layer(mod) == "_front"]
    assert not bad, bad


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for p in MODULES:
        me = module_name(p)
        graph[me] = {m for m, _, _ in imports(p) if m in NAMES and m != me
                     and not me.startswith(m + ".")}   # (a module's own package: its init)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle():
    found = cycles(_import_graph())
    assert not found, f"import cycles (imports inside functions count): {found}"


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_private_name_crosses_a_module(path):
    bad = [f"line {line}: {n} from {mod}" for mod, names, line in imports(path)
           for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad


def test_the_rules_see_the_imports_they_check():
    """The reader resolves relative, package and function-level imports (so the rules
    above cannot pass by reading nothing)."""
    fold = {m for m, _, _ in imports(PKG / "_fold" / "jaxpr" / "fold.py")}
    assert "hlofold._compat" in fold and "hlofold._base.report" in fold
    assert "hlofold._fold.jaxpr.nested" in fold
    cli = {m for m, _, _ in imports(PKG / "_front" / "cli.py")}
    assert "hlofold._ir.stablehlo.artifacts" in cli          # imported inside functions
    weights = {m for m, _, _ in imports(PKG / "_front" / "artifacts.py")}
    assert "hlofold._ir.stablehlo.blobs" in weights          # ``from … import blobs``
    assert layer("hlofold._fold.stablehlo.fold") == "_fold.stablehlo"
    assert layer("hlofold._front.api") == "_front"
    assert len(_import_graph()) == len(MODULES)


def _documented_paths() -> list[str]:
    """The module paths docs/architecture.md's map names (its first ``` block, a tree)."""
    text = ARCHITECTURE.read_text()
    block = text.split("```", 2)[1]
    out, stack = [], []
    for line in block.splitlines()[1:]:
        m = re.match(r"^([│ ]*)(?:├── |└── )(\S+)", line)
        if not m:
            continue
        depth = len(m.group(1)) // 4
        name = m.group(2)
        stack[depth:] = [name]
        if name.endswith("/"):
            continue
        for n in name.split(","):
            if n.strip():
                out.append("hlofold/" + "".join(stack[:-1]) + n.strip())
    return out


def test_the_architecture_map_is_the_tree():
    documented = set(_documented_paths())
    actual = {str(p.relative_to(PKG.parent)) for p in MODULES
              if p.name != "__init__.py" or p.parent == PKG}
    assert documented, "docs/architecture.md has no map"
    missing = sorted(documented - actual)
    left_out = sorted(actual - documented)
    assert not missing, f"docs/architecture.md maps paths that do not exist: {missing}"
    assert not left_out, f"docs/architecture.md's map leaves out: {left_out}"


def test_the_public_api_is_what_init_exports():
    assert sorted(hlofold.__all__) == sorted(
        ["CompatError", "Folded", "FoldReport", "FoldSite", "FoldedParams", "ParamChange",
         "Split", "StableHLOError", "VerificationError", "VerifyReport", "callable",
         "export", "fold", "fold_jaxpr", "fold_params", "fold_stablehlo", "lower", "verify"])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_compat_reads_jax_internals(path):
    """JAX internals (``jax._src``, jaxlib's bindings) are read in ``hlofold._compat`` only,
    where each goes through one check (``_compat.lookup.internal``)."""
    if layer(module_name(path)) == "_compat":
        return
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        bad += [f"line {node.lineno}: {m}" for m in mods
                if m.startswith(("jax._src", "jaxlib")) or m == "jax.extend.mlir"
                or m.startswith("jax.extend.mlir.")]
    assert not bad, f"{module_name(path)} imports JAX internals: {bad}"
