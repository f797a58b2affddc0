"""What a StableHLO fold writes, through jaxlib's MLIR bindings.

The op builders (one call to the generic builder per op), the markers hlofold leaves on the
ops it writes (``GUARD``, ``PREPARED``), the arithmetic the s/t algebra runs on in the graph
(:class:`IrArith`), and the guards' finiteness test (:func:`all_finite`). The vocabulary for
reading ops is :mod:`hlofold._ir.stablehlo.ir`.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._base.algebra import per_channel
from hlofold._base.chain_rules import Block
from .ir import numpy_to_dense, shape_of

ir, stablehlo, func_dialect = C.mlir()


class IrArith:
    """The arithmetic ``collapse`` needs, as StableHLO ops on tensor<c x f32>; used inside an
    insertion point. Host values (NumPy, Python numbers) stay on the host, also through
    arithmetic among themselves, until an op reads them: then they become a constant (so
    an identity ``collapse`` adds, such as a zero shift nothing reads, writes nothing)."""

    def __init__(self, c: int, ct):
        self.c, self.ct = c, ct

    def asarray(self, x):
        return x

    def value(self, x):
        """``x`` in the graph (a constant for a host value)."""
        if is_host(x):
            return stablehlo.ConstantOp(numpy_to_dense(per_channel(x, self.c), self.ct)).result
        return x

    def _binary(self, host_op, op, a, b):
        if is_host(a) and is_host(b):
            return host_op(np.asarray(a, np.float64), np.asarray(b, np.float64))
        return op(self.value(a), self.value(b)).result

    def add(self, a, b):
        return self._binary(np.add, stablehlo.AddOp, a, b)

    def sub(self, a, b):
        return self._binary(np.subtract, stablehlo.SubtractOp, a, b)

    def mul(self, a, b):
        return self._binary(np.multiply, stablehlo.MulOp, a, b)

    def div(self, a, b):
        return self._binary(np.divide, stablehlo.DivOp, a, b)

    def neg(self, a):
        return np.negative(np.asarray(a, np.float64)) if is_host(a) else \
            stablehlo.NegOp(a).result


def is_host(x) -> bool:
    """Whether ``x`` is a value on the host (not one in the graph)."""
    return isinstance(x, (np.ndarray, np.generic, float, int))


# Marks hlofold leaves on ops it writes, as frontend attributes (``mhlo.frontend_attributes``,
# which every serialization keeps, portable artifacts included, and XLA ignores):
GUARD = "hlofold_guard"          # a site's run-time guard: already folded
PREPARED = "hlofold_prepared"    # an unguarded folded kernel or bias (checked by split)
STACK = "hlofold_stack"          # a loop whose body folded per layer (the pass skips it)
_FRONTEND = "mhlo.frontend_attributes"


def make(name: str, results, operands, attributes=None, regions: int = 0):
    """A new op ``name`` where you are: one call to the bindings' generic builder (a
    dialect's generated builder is the same op in ~2 µs of Python, with types inferred)."""
    return ir.Operation.create(name, results=results, operands=operands,
                               attributes=attributes, regions=regions)


def broadcast(rtype, value, dims):
    """``stablehlo.broadcast_in_dim`` of ``value`` to the type ``rtype`` (a value)."""
    return make("stablehlo.broadcast_in_dim", [rtype], [value],
                {"broadcast_dimensions": ir.DenseI64ArrayAttr.get(dims)}).result


def broadcast_channels(rtype, value, axis):
    """A per-channel vector ``value`` (C,) broadcast to ``rtype`` along ``axis``: an int, or
    a ``chain_rules.Block`` ((heads, head_dim): the vector reshaped to the block first)."""
    if not isinstance(axis, Block):
        return broadcast(rtype, value, [axis])
    et = ir.RankedTensorType(value.type).element_type
    value = make("stablehlo.reshape", [ir.RankedTensorType.get(list(axis.dims), et)],
                 [value]).result
    return broadcast(rtype, value, list(axis.axes))


def marker(name: str) -> dict:
    """The attributes of a new op carrying the marker ``name`` (see :func:`mark`)."""
    return {_FRONTEND: ir.DictAttr.get({name: ir.StringAttr.get("")})}


def mark(op, name: str) -> None:
    """Add the marker ``name`` to ``op``'s frontend attributes."""
    op = op.operation
    old = {a.name: a.attr for a in ir.DictAttr(op.attributes[_FRONTEND])} \
        if _FRONTEND in op.attributes else {}
    op.attributes[_FRONTEND] = ir.DictAttr.get({**old, name: ir.StringAttr.get("")})


def marked(op, name: str) -> bool:
    """Whether ``op`` carries the marker ``name``."""
    attrs = op.operation.attributes
    return _FRONTEND in attrs and name in ir.DictAttr(attrs[_FRONTEND])


def unmark(op, name: str) -> None:
    op = op.operation
    left = {a.name: a.attr for a in ir.DictAttr(op.attributes[_FRONTEND]) if a.name != name}
    if left:
        op.attributes[_FRONTEND] = ir.DictAttr.get(left)
    else:
        del op.attributes[_FRONTEND]


def all_finite(value, templates: dict | None = None):
    """A ``tensor<i1>``: every element of ``value`` is finite (insert where you are).
    ``templates``: what the calls so far made, shared: a later reduction of the same rank is
    a clone of the first with its operands set (one call, not a reduction built and its body
    filled op by op), and its ``true`` initial value is one constant at the start of the
    insertion block (it dominates every use there)."""
    shape = shape_of(value)
    rank = len(shape)
    i1 = ir.IntegerType.get_signless(1)
    fin = make("stablehlo.is_finite", [ir.RankedTensorType.get(shape, i1)], [value]).result
    scalar = ir.RankedTensorType.get([], i1)
    init = None
    if templates is not None:
        block = ir.InsertionPoint.current.block
        init = templates.get(("true", block))
        if init is None:
            with ir.InsertionPoint.at_block_begin(block):
                init = templates[("true", block)] = _true(scalar)
    made = None if templates is None else templates.get(rank)
    if made is not None:
        red = made.clone()
        red.operands[0] = fin
        red.operands[1] = init
        return red.results[0]
    red = stablehlo.ReduceOp([scalar], [fin], [init if init is not None else _true(scalar)],
                             ir.DenseI64ArrayAttr.get(list(range(rank))))
    body = red.body.blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        stablehlo.ReturnOp([stablehlo.AndOp(body.arguments[0], body.arguments[1]).result])
    if templates is not None:
        templates[rank] = red.operation
    return red.results[0]


def int_constant(rtype, value: int):
    """A ``stablehlo.constant`` of integer type ``rtype`` (a tensor type), every element
    ``value`` (insert where you are): loop counters, slice starts."""
    t = ir.RankedTensorType(rtype)
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
        t, ir.IntegerAttr.get(t.element_type, int(value)))).result


def _true(scalar):
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
        scalar, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), 1))).result
