"""jaxlib's MLIR bindings and JAX's export internals: what the StableHLO adapter needs.

The bindings are looked up through :func:`lookup.internal` (feature ``"stablehlo"``); the
``jax.export`` internals under ``"export"``. A missing one switches its feature off.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax

from .lookup import CompatError, Missing, internal, mark_changed

bfloat16 = jax.numpy.bfloat16

_ir = internal("stablehlo", "jax.extend.mlir.ir", "jaxlib.mlir.ir")
_stablehlo = internal("stablehlo", "jax.extend.mlir.dialects.stablehlo",
                      "jaxlib.mlir.dialects.stablehlo")
_func = internal("stablehlo", "jax.extend.mlir.dialects.func", "jaxlib.mlir.dialects.func")
_make_ir_context = internal("stablehlo", "jax._src.interpreters.mlir:make_ir_context")
_module_to_bytecode = internal("export", "jax._src.export._export:_module_to_bytecode")

# What the StableHLO adapter calls on the bindings (a renamed one switches the path off
# instead of failing in the middle of a fold).
_BINDINGS = {
    "ir": ("ArrayAttr", "BF16Type", "BlockArgument", "ComplexType", "DenseBoolArrayAttr",
           "DenseElementsAttr", "DenseI64ArrayAttr", "DenseIntElementsAttr", "DictAttr",
           "F16Type", "F32Type", "F64Type", "FlatSymbolRefAttr", "FloatAttr", "FunctionType",
           "InsertionPoint", "IntegerAttr", "IntegerType", "Location", "Module", "Operation",
           "RankedTensorType", "StringAttr", "TypeAttr"),
    "stablehlo": ("AddOp", "AndOp", "BroadcastInDimOp", "ConstantOp", "ConvDimensionNumbers",
                  "ConvertOp", "DivOp", "DotDimensionNumbers", "MulOp", "NegOp", "ReduceOp",
                  "ReshapeOp", "ReturnOp", "RsqrtOp", "SubtractOp", "TransposeOp",
                  "serialize_portable_artifact", "deserialize_portable_artifact"),
}


def _check_bindings() -> None:
    """Record each name of :data:`_BINDINGS` the bindings lack (a moved module is recorded
    by :func:`internal` already)."""
    for mod_name, names in _BINDINGS.items():
        mod = {"ir": _ir, "stablehlo": _stablehlo}[mod_name]
        if isinstance(mod, type) and issubclass(mod, Missing):
            continue
        for n in names:
            if not hasattr(mod, n):
                mark_changed(f"jaxlib.mlir.{mod_name}.{n}", "stablehlo",
                             f"jaxlib's MLIR bindings ({mod_name}.{n} not found)")


_check_bindings()


def mlir():
    """jaxlib's bundled MLIR Python bindings: ``(ir, stablehlo, func)`` (stand-ins raising
    :class:`CompatError` when used, where this JAX moved them)."""
    return _ir, _stablehlo, _func


def location_view(loc) -> tuple[str, object]:
    """``(kind, view)`` of an MLIR location: kind "file", "name", "fused", "callsite" or
    "unknown", ``view`` with that kind's accessors (jaxlib 0.10.2 has a class per kind;
    0.10.0 puts ``is_a_*()`` and every accessor on ``Location``)."""
    ir = _ir
    if hasattr(ir, "FileLineColLoc"):
        for kind, cls in (("file", ir.FileLineColLoc), ("name", ir.NameLoc),
                          ("fused", ir.FusedLoc), ("callsite", ir.CallSiteLoc)):
            try:
                return kind, cls(loc)
            except Exception:
                continue
        return "unknown", loc
    for kind in ("file", "name", "fused", "callsite"):
        test = getattr(loc, f"is_a_{kind}", None)
        if test is not None and test():
            return kind, loc
    return "unknown", loc


def constants_in_module():
    """A context in which a lowering keeps the arrays a function closes over in the module,
    as constants: JAX 0.12.1 passes them as ``@main`` arguments marked ``jax.const``
    (``jax_use_simplified_jaxpr_constants``, on by default there), whose values a module's
    text then lacks — what ``hlofold.lower(..., freeze=)`` promises is a module that holds
    them ("params baked in"). The option's own context (this thread's lowerings only); on a
    JAX without it, lowerings as that JAX makes them."""
    try:
        from jax._src import config as jax_config
        state = jax_config.use_simplified_jaxpr_constants
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
    return state(False)


def mlir_context():
    """A fresh MLIR context with the dialects JAX registers (stablehlo, chlo, func, ...)."""
    return _make_ir_context()


def module_to_portable_artifact(module) -> bytes:
    """Serialize a module as JAX serializes exported modules (a StableHLO portable artifact)."""
    return _module_to_bytecode(module)


def exported_input_shardings(exp) -> tuple:
    """The shardings of an ``Exported``'s inputs: its named shardings where it keeps them
    (jax 0.10, Shardy), else its HLO shardings (None: unsharded)."""
    named = getattr(exp, "_in_named_shardings", None)
    return tuple(named) if named is not None else tuple(exp.in_shardings_hlo)


_EXPORTED_FIELDS = ("in_tree", "in_avals", "in_shardings_hlo", "module_kept_var_idx",
                    "mlir_module_serialized")


def exported_with_inputs(exp, kept, new_avals, module_bytes, new_from=None, used=None):
    """``exp`` (a ``jax.export.Exported``) with the module ``module_bytes`` whose inputs are
    ``exp``'s inputs ``kept`` (in order) and then new inputs of ``new_avals``: flat
    positional inputs. ``new_from[j]``: the input of ``exp`` whose sharding the new input
    ``j`` takes (None: unsharded). ``used``: the positions, among those inputs, of the ones
    the module takes (``module_kept_var_idx``; default all). Touches ``Exported``'s private
    sharding fields (jax 0.10)."""
    from .jaxpr import ShapedArray
    names = {f.name for f in dataclasses.fields(exp)}
    if not set(_EXPORTED_FIELDS) <= names:
        raise CompatError("jax.export.Exported's fields (expected "
                          + ", ".join(sorted(set(_EXPORTED_FIELDS) - names)) + ")", "export")
    avals = [exp.in_avals[i] for i in kept] + [ShapedArray(a.shape, a.dtype)
                                               for a in new_avals]
    new_from = list(new_from) if new_from is not None else [None] * len(new_avals)
    extra = tuple(None if i is None else exp.in_shardings_hlo[i] for i in new_from)
    fields = dict(
        in_tree=jax.tree_util.tree_structure((tuple(range(len(avals))), {})),
        in_avals=tuple(avals),
        in_shardings_hlo=tuple(exp.in_shardings_hlo[i] for i in kept) + extra,
        module_kept_var_idx=tuple(range(len(avals))) if used is None else tuple(used),
        mlir_module_serialized=module_bytes)
    named = getattr(exp, "_in_named_shardings", None)
    if named is not None:
        fields["_in_named_shardings"] = tuple(named[i] for i in kept) + tuple(
            None if i is None else named[i] for i in new_from)
    return dataclasses.replace(exp, **fields)


def ops_named(op, name: str) -> list:
    """Every op named ``name`` in ``op`` (a module, a function), nested regions included, in
    program order: the bindings' own walk (C++; a Python walk where these bindings lack it)."""
    ir = mlir()[0]
    found = []
    walk = getattr(op.operation, "walk", None)
    if walk is not None and hasattr(ir, "WalkResult"):
        def visit(o):
            if o.name == name:
                found.append(o.opview)
            return ir.WalkResult.ADVANCE
        walk(visit)
        return found
    todo = [op.operation]
    while todo:
        o = todo.pop()
        if o.name == name:
            found.append(o.opview)
        todo.extend(reversed([i.operation for r in o.regions for b in r.blocks
                              for i in b.operations]))
    return found
