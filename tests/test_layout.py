"""The package layout is the architecture: these import rules keep it true.

* ``hlofold._core`` (IR-agnostic: patterns, chain and forward walks, decide, rules, algebra,
  tolerance, reasons, report) imports no other part of hlofold;
* each IR adapter (``hlofold._jaxpr``, ``hlofold._stablehlo``) imports the core,
  ``hlofold._compat`` and itself only: not the other adapter, not the front ends;
* ``hlofold._compat`` (every use of JAX internals and MLIR bindings) imports no hlofold module
  outside itself, and no other module reads ``jax._src`` or ``jaxlib``'s internals;
* no module imports another's private name (``from .x import _y``): a helper two modules
  need is a named internal API;
* every module is small enough to read in one sitting (under 400 lines).

The imports are read from the source (``ast``), function-level imports included.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import hlofold

PKG = pathlib.Path(hlofold.__file__).parent
MODULES = sorted(PKG.rglob("*.py"))
ADAPTERS = ("hlofold._jaxpr", "hlofold._stablehlo")


def module_name(path: pathlib.Path) -> str:
    parts = ("hlofold",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
                # ``from . import _compat``: the names are modules
                subs = [f"{mod}.{n}" for n in names if (PKG.parent / f"{mod}.{n}".replace(
                    ".", "/")).with_suffix(".py").exists() or (PKG.parent / f"{mod}.{n}".replace(
                        ".", "/")).is_dir()]
                out += [(s, [], node.lineno) for s in subs] if subs else \
                    [(mod, names, node.lineno)]
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names
                    if a.name.startswith("hlofold")]
    return out


def part(mod: str) -> str:
    """The layer a module belongs to: core, an adapter, compat, or a front end."""
    for p in ("hlofold._core",) + ADAPTERS + ("hlofold._compat",):
        if mod == p or mod.startswith(p + "."):
            return p
    return "front end"


ALLOWED = {
    "hlofold._core": {"hlofold._core"},
    "hlofold._jaxpr": {"hlofold._core", "hlofold._compat", "hlofold._jaxpr"},
    "hlofold._stablehlo": {"hlofold._core", "hlofold._compat", "hlofold._stablehlo"},
    "hlofold._compat": {"hlofold._compat"},
}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_each_layer_imports_only_what_it_may(path):
    me = part(module_name(path))
    if me not in ALLOWED:
        return                                   # front ends may import anything
    bad = [f"line {line}: {mod}" for mod, _, line in imports(path)
           if part(mod) not in ALLOWED[me] and mod != "hlofold"]
    assert not bad, f"{module_name(path)} ({me}) imports {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_private_name_crosses_a_module(path):
    bad = [f"line {line}: {n} from {mod}" for mod, names, line in imports(path)
           for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_each_module_reads_in_one_sitting(path):
    n = len(path.read_text().splitlines())
    assert n < 400, f"{module_name(path)} has {n} lines"


def test_the_rules_see_the_imports_they_check():
    """The reader resolves relative, package and function-level imports (so the rules
    above cannot pass by reading nothing)."""
    fold = imports(PKG / "_jaxpr" / "fold.py")
    mods = {m for m, _, _ in fold}
    assert "hlofold._compat" in mods and "hlofold._core.report" in mods
    assert "hlofold._jaxpr.nested" in mods
    cli = {m for m, _, _ in imports(PKG / "_cli.py")}
    assert "hlofold._stablehlo.artifacts" in cli          # imported inside functions
    assert part("hlofold._stablehlo.fold") == "hlofold._stablehlo"
    assert part("hlofold._api") == "front end"


def test_the_public_api_is_what_init_exports():
    assert sorted(hlofold.__all__) == sorted(
        ["Folded", "FoldReport", "FoldSite", "FoldedParams", "ParamChange", "Split",
         "StableHLOError", "VerificationError", "VerifyReport", "export", "fold",
         "fold_jaxpr", "fold_params", "fold_stablehlo", "lower", "verify"])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_compat_reads_jax_internals(path):
    """JAX internals (``jax._src``, jaxlib's bindings) are read in ``hlofold._compat`` only,
    where each goes through one check (``_compat.lookup.internal``)."""
    if part(module_name(path)) == "hlofold._compat":
        return
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        bad += [f"line {node.lineno}: {m}" for m in mods
                if m.startswith(("jax._src", "jaxlib")) or m == "jax.extend.mlir"
                or m.startswith("jax.extend.mlir.")]
    assert not bad, f"{module_name(path)} imports JAX internals: {bad}"
