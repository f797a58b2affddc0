"""Spellings the walks read in another form, rewritten before a module is folded: the
StableHLO side of ``_fold.jaxpr.canonical``.

A norm's scale applied as ``jnp.einsum("...k,k->...k", y, scale)`` (MaxText's RMSNorm and
LayerNorm) exports as a ``stablehlo.dot_general`` that contracts nothing — one operand made
of batch dimensions only — then a ``stablehlo.transpose`` back to ``...k``. Each output
element is the single product ``y[..., k] · scale[k]``; :func:`products` writes it as
``multiply(y, broadcast_in_dim(scale))`` in ``y``'s layout (converted to the dot's result
type), then the dot's transpose, composed with a transpose that reads it alone (none left for
einsum's). The values are the same; every walk then reads a per-channel multiply.
"""
from __future__ import annotations

from hlofold import _compat as C
from hlofold._fold.core.patterns import product_layout
from hlofold._ir.stablehlo.build import broadcast, make
from hlofold._ir.stablehlo.ir import attr_dims, elem_type, is_float, op_name, shape_of
from .patterns import dot_dims

ir, stablehlo, _ = C.mlir()


def _as_product(op):
    """:func:`hlofold._fold.core.patterns.product_layout` of a float, static-shaped
    ``dot_general``."""
    if op_name(op) != "stablehlo.dot_general" or len(op.results) != 1:
        return None
    lb, lc, rb, rc = dot_dims(op)
    if lc or rc or not lb:               # (every layer contracts: read nothing more)
        return None
    vals = list(op.operands) + [op.results[0]]
    if not all(is_float(v) for v in vals) or \
            any(d < 0 for v in vals for d in shape_of(v)):     # (static shapes only)
        return None
    return product_layout(len(shape_of(op.operands[0])), len(shape_of(op.operands[1])),
                          lc, rc, lb, rb)


def _typed(shape, et):
    return ir.RankedTensorType.get(list(shape), et)


def _convert(value, et):
    if elem_type(value) == et:
        return value
    return make("stablehlo.convert", [_typed(shape_of(value), et)], [value]).result


def _transpose(value, perm):
    shape = shape_of(value)
    return make("stablehlo.transpose", [_typed([shape[p] for p in perm], elem_type(value))],
                [value],
                {"permutation": ir.DenseI64ArrayAttr.get(list(perm))}).result


def _rewrite(op, found) -> None:
    xi, perm, vi, vb, xb = found
    out = op.results[0]
    et = elem_type(out)
    x, v = op.operands[xi], op.operands[vi]
    order = sorted(range(len(vb)), key=lambda k: xb[k])
    readers = [u.owner for u in out.uses]
    after = readers[0] if len(readers) == 1 and \
        op_name(readers[0]) == "stablehlo.transpose" else None
    with op.location, ir.InsertionPoint(op):
        vperm = [vb[k] for k in order]
        if vperm != sorted(vperm):
            v = _transpose(v, vperm)
        x = _convert(x, et)
        t = make("stablehlo.multiply", [x.type],
                 [x, broadcast(x.type, _convert(v, et), [xb[k] for k in order])]).result
        if after is None:
            if list(perm) != list(range(len(perm))):
                t = _transpose(t, perm)
            out.replace_all_uses_with(t)
            op.operation.erase()
            return
    p2 = attr_dims(after, "permutation")
    q = [perm[k] for k in p2]
    with after.location, ir.InsertionPoint(after):
        if q != list(range(len(q))):
            t = _transpose(t, q)
    after.results[0].replace_all_uses_with(t)
    after.operation.erase()
    op.operation.erase()


def products(module) -> int:
    """Rewrite every ``dot_general`` of ``module`` that is a product by a vector of batch
    dimensions (call inside its context); returns how many."""
    todo = [(op, f) for op in C.ops_named(module, "stablehlo.dot_general")
            if (f := _as_product(op)) is not None]
    for op, f in todo:
        _rewrite(op, f)
    return len(todo)
