"""The s/t algebra staged in a trace (the jaxpr adapter's in-graph arithmetic).

The same collapse and kernel placement as :mod:`hlofold._base.algebra`, with ``lax`` ops for
values known only when the program runs; known operands stay NumPy and are computed on the
host. The StableHLO adapter's counterpart is ``hlofold._ir.stablehlo.build.IrArith``.
"""
from __future__ import annotations

import functools

import numpy as np
from jax import lax

from hlofold._base.algebra import along, group_matrix_np, place_np
from hlofold._base.chain_rules import Block, on_axis


@functools.lru_cache(maxsize=None)
def lax_arith(cdt):
    """Arithmetic staged with ``lax`` in ``cdt`` (no ``jnp`` dispatch: folding stays cheap);
    operands that are known stay NumPy constants. One namespace per dtype (made once)."""

    def lift(x):
        if isinstance(x, np.ndarray) or np.isscalar(x):
            return np.asarray(x, np.float64).astype(cdt)
        return x

    def binary(np_op, lax_op):
        def op(a, b):
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
                return np_op(a, b).astype(cdt)
            a, b = lift(a), lift(b)     # a NumPy operand takes the arithmetic dtype
            # scalars are broadcast explicitly; equal ranks rely on lax's size-1 broadcasting
            shape = np.broadcast_shapes(np.shape(a), np.shape(b))
            a, b = (x if np.ndim(x) or not shape else
                    (np.broadcast_to(x, shape) if isinstance(x, np.ndarray)
                     else lax.broadcast_in_dim(x, shape, ())) for x in (a, b))
            return lax_op(a, b)
        return staticmethod(op)

    class _ns:
        asarray = staticmethod(lift)
        add = binary(np.add, lax.add)
        sub = binary(np.subtract, lax.sub)
        mul = binary(np.multiply, lax.mul)
        div = binary(np.divide, lax.div)

        @staticmethod
        def neg(x):
            return np.negative(x) if isinstance(x, np.ndarray) else lax.neg(x)
    return _ns


def group_matrix_traced(vec, out_channels: int, groups: int):
    if isinstance(vec, np.ndarray):
        return group_matrix_np(vec, out_channels, groups)
    if vec.ndim == 0:
        return vec
    ipg = vec.shape[0] // groups
    m = lax.broadcast_in_dim(lax.reshape(vec, (groups, ipg)),
                             (groups, out_channels // groups, ipg), (0, 2))
    return lax.reshape(m, (out_channels, ipg))


def place_traced(m, o_axis: int, i_axis: int, ndim: int):
    if isinstance(m, np.ndarray) or np.ndim(m) == 0:
        return place_np(m, o_axis, i_axis, ndim) if isinstance(m, np.ndarray) else m
    if o_axis > i_axis:
        m = lax.transpose(m, (1, 0))
    shape = [1] * ndim
    lo, hi = sorted((o_axis, i_axis))
    shape[lo], shape[hi] = m.shape[0], m.shape[1]
    return lax.reshape(m, tuple(shape))


def input_traced(vec, ko, ki: int, groups: int, out_channels: int, ndim: int):
    """A per-input-channel vector placed on a kernel (``_base.algebra.input_scale`` in the
    graph): along ``ki`` for one group (``ko`` may then be a Block), else each output
    channel's group matrix."""
    if groups == 1:
        return along_traced(vec, ki, ndim)
    return place_traced(group_matrix_traced(vec, out_channels, groups), ko, ki, ndim)


def reduce_but(x, axis):
    """Sum ``x`` over every axis but ``axis`` (a Block's: flattened to its channels)."""
    axes = tuple(a for a in range(x.ndim) if not on_axis(a, axis))
    if isinstance(x, np.ndarray):
        return np.sum(x, axis=axes).reshape(-1)
    r = lax.reduce_sum(x, axes)
    return lax.reshape(r, (axis.size,)) if isinstance(axis, Block) else r


def cast(x, dtype):
    """``convert_element_type`` only when the dtype changes (no equation otherwise)."""
    if np.dtype(x.dtype) == np.dtype(dtype) and not getattr(x, "weak_type", False):
        return x
    return lax.convert_element_type(x, dtype)


# (reshape, broadcast_to) in the graph, for _base.chain_rules.block_values
LAX_BROADCAST = (lax.reshape, lambda v, d: lax.broadcast_in_dim(v, d, tuple(range(len(d)))))


def along_traced(vec, axis, ndim: int):
    if isinstance(vec, np.ndarray):
        return along(vec, axis, ndim)
    if vec.ndim == 0:
        return vec
    shape = [1] * ndim
    if isinstance(axis, Block):       # (heads, head_dim): the vector's row-major reshape
        for a, d in zip(axis.axes, axis.dims):
            shape[a] = d
        return lax.broadcast_in_dim(lax.reshape(vec, axis.dims), tuple(shape), axis.axes)
    shape[axis] = vec.shape[0]
    return lax.broadcast_in_dim(vec, tuple(shape), (axis,))
