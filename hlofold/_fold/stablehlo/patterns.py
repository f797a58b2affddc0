"""StableHLO roots and per-channel operands: the StableHLO side of the matcher.

:func:`root_info` reads a convolution or dot: which output dimension carries the features,
which operand is the kernel and along which axis (layouts named by ``_fold.core.patterns``);
:func:`resolve` traces a binary op's other operand back to a source that varies only along
the feature dimension; :class:`Evaluator` computes constant sub-expressions on the host.
"""
from __future__ import annotations

import math
import dataclasses
from typing import Any

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._base.chain_rules import Refusal, channel_count, resolve_channel_operand
from hlofold._base.reasons import Reason
from hlofold._fold.core.rules import flushes_differently
from hlofold._ir.stablehlo.facts import op_fact
from hlofold._ir.stablehlo.ir import (DOTS, constant_attr, constant_values, dense_to_numpy, elem_type,
                                      int_dims, is_float, np_dtype, op_name, owner_op,
                                      shape_of)
from hlofold._ir.stablehlo.indices import index_value
from hlofold._ir.stablehlo.module import call_sites, entering_value
from hlofold._fold.core.patterns import (RootInfo, block_of, conv_axis_role, conv_layout,
                                         dot_axis_role, dot_layout)

ir, stablehlo, func_dialect = C.mlir()


@dataclasses.dataclass
class Operand:
    value: Any                 # smallest per-channel source
    axis: int | None           # its channel axis (None: scalar-like)
    casts: tuple               # element types converted to, in order
    size: int
    block: tuple | None = None       # on a (heads, head_dim) Block: the source's extents
    block_dims: tuple | None = None  # ... and the block's (_base.chain_rules.block_values)


@dataclasses.dataclass
class Step:
    op: Any
    kind: str                  # add/sub/rsub/mul/div/neg/bn/convert
    operand: Operand | None = None
    bn: dict | None = None     # batch_norm_inference operands
    axis: int = 0              # the channel axis of its result


class Evaluator:
    """Values of constant sub-expressions (on the host, in float64, rounded to each op's
    type), memoized. Iterative: a chain of constant ops is as deep as the module.

    A value whose host result depends on subnormal numbers a backend flushes
    (``_fold.core.rules.flushes_differently``) is left unknown and recorded in ``flushed``."""

    _UNARY = {"stablehlo.negate": np.negative, "stablehlo.sqrt": np.sqrt,
              "stablehlo.rsqrt": lambda a: 1.0 / np.sqrt(a), "stablehlo.exponential": np.exp}
    _BIN = {"stablehlo.add": np.add, "stablehlo.subtract": np.subtract,
            "stablehlo.multiply": np.multiply, "stablehlo.divide": np.divide,
            "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum}
    _MOVES = frozenset({"stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose",
                        "stablehlo.broadcast_in_dim", "stablehlo.slice",
                        "sdy.sharding_constraint"})       # (where they live: the same values)

    def __init__(self, module=None, bound: dict | None = None):
        self.memo: dict[Any, np.ndarray | None] = {}
        self.flushed: set = set()
        self.module = module
        self._calls: dict | None = None
        # block arguments whose values are given (one layer of a scanned stack: its
        # counters and the known loop operands, ``_fold.stablehlo.stacks``)
        self.bound: dict = dict(bound or {})

    @property
    def calls(self) -> dict:
        """Private function name -> its call ops (found on first use)."""
        if self._calls is None:
            self._calls = {} if self.module is None else call_sites(self.module)
        return self._calls

    def _inputs(self, value) -> list:
        """The values ``value``'s host value is computed from (none: a leaf)."""
        if value in self.bound:
            return []
        op = owner_op(value)
        if op is None:
            outer = entering_value(value, lambda: self.calls)
            return [] if outer is None else [outer]
        name = op_name(op)
        if name == "stablehlo.dynamic_slice" and is_float(value):
            return [op.operands[0]]      # (the start indices: index_value)
        if not is_float(value) or name == "stablehlo.constant" or \
                (name not in self._UNARY and name not in self._BIN and name not in self._MOVES):
            return []
        return list(op.operands)

    def __call__(self, value) -> np.ndarray | None:
        """``value``'s host value, or None (not a constant sub-expression)."""
        memo = self.memo
        if value in memo:
            return memo[value]
        stack = [value]
        while stack:                # depth first, each value once (no Python recursion)
            v = stack[-1]
            if v in memo:
                stack.pop()
                continue
            inputs = self._inputs(v)
            missing = [u for u in inputs if u not in memo]
            if missing:
                stack.extend(missing)
                continue
            memo[v] = self._settle(v, inputs)
            stack.pop()
        return memo[value]

    def _settle(self, value, inputs: list):
        """``value``'s host value from its ``inputs``' (already in ``memo``)."""
        if value in self.bound:
            return self.bound[value]
        op = owner_op(value)
        ins = [self.memo[u] for u in inputs]
        if any(u in self.flushed for u in inputs):
            self.flushed.add(value)
            return None
        if op is not None and op_name(op) == "stablehlo.dynamic_slice":
            return self._dynamic_slice(op, ins[0])
        if op is None:
            return ins[0] if ins else None
        name = op_name(op)
        if name == "stablehlo.constant":      # (an int8/fp8 kernel: read where converted)
            attr = constant_attr(op)
            if attr is None:                  # (complex: not a value the fold reads)
                return None
            return dense_to_numpy(attr, copy=False) if is_float(value) else \
                constant_values(attr)
        if not is_float(value):
            return None
        if not ins or any(x is None for x in ins):
            return None
        dt = np_dtype(elem_type(value))
        fn = None
        if name in self._UNARY:
            f = self._UNARY[name]
            fn = lambda a: f(a.astype(np.float64)).astype(dt)                 # noqa: E731
        elif name in self._BIN:
            f = self._BIN[name]
            fn = lambda a, b: f(a.astype(np.float64), b.astype(np.float64)).astype(dt)  # noqa
        if fn is not None:
            with np.errstate(all="ignore"):
                out = fn(*ins)
            if flushes_differently(fn, ins, out):
                self.flushed.add(value)
                return None
            return out
        x = ins[0]
        if name == "sdy.sharding_constraint":
            return x
        if name == "stablehlo.convert":
            return x.astype(dt)
        if name == "stablehlo.reshape":
            return x.reshape(shape_of(value))
        if name == "stablehlo.transpose":
            return np.transpose(x, int_dims(op.attributes["permutation"]))
        if name == "stablehlo.slice":        # a view (an unrolled scan's layer of a stack)
            return x[tuple(slice(a, b, c) for a, b, c in zip(
                *(int_dims(op.attributes[k]) for k in ("start_indices", "limit_indices",
                                                       "strides"))))]
        dims = int_dims(op.attributes["broadcast_dimensions"])      # broadcast_in_dim
        shape = shape_of(value)
        exp = [1] * len(shape)
        for i, d in enumerate(dims):
            exp[d] = x.shape[i]
        return np.broadcast_to(x.reshape(exp), shape).astype(dt)

    def _dynamic_slice(self, op, x):
        """``dynamic_slice`` of a known operand at start indices known now (clamped into
        the operand, as the op defines): a view of it."""
        if x is None:
            return None
        sizes = int_dims(op.attributes["slice_sizes"])
        starts = [index_value(s, self.bound, calls=lambda: self.calls)
                  for s in op.operands[1:]]
        if any(s is None for s in starts):
            return None
        starts = [min(max(s, 0), d - n) for s, d, n in zip(starts, x.shape, sizes)]
        return x[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]


# the ops :func:`resolve` walks back through (broadcasts, reshapes, float casts): a value
# produced by anything else, varying along two axes, is not per channel
SHAPE_STEPS = ops.names(lambda o: o.shape in ("broadcast", "dynamic_broadcast", "reshape",
                                             "cast"))


def resolve(value, out_shape, axis, explain: bool = True) -> Operand | Refusal:
    """Trace ``value`` back to a source varying only along ``axis`` of ``out_shape``: the
    shared rule :func:`~hlofold._base.chain_rules.resolve_channel_operand` on StableHLO
    (``explain=False``: a refusal without its words, for callers that only ask)."""
    def step_of(v):
        op = owner_op(v)
        if op is None or (name := op_name(op)) not in SHAPE_STEPS:
            return None
        if name == "stablehlo.broadcast_in_dim":
            return "broadcast_in_dim", op.operands[0], int_dims(
                op.attributes["broadcast_dimensions"])
        if name == "stablehlo.reshape":
            return "reshape", op.operands[0], None
        if name == "stablehlo.convert" and is_float(op.operands[0]) and is_float(v):
            return "convert", op.operands[0], elem_type(v)
        if name == "stablehlo.dynamic_broadcast_in_dim":
            return "dynamic", op.operands[0], None
        return None
    got = resolve_channel_operand(value, out_shape, axis, step_of, shape_of, explain)
    if isinstance(got, Refusal):
        return got
    return Operand(got.source, got.source_axis, got.casts, got.size, got.block, got.block_dims)


def axis_role(op, axis: int) -> str:
    """What output axis ``axis`` of root ``op`` is (the shared words of ``_fold.core.patterns``)."""
    if op_name(op) == "stablehlo.convolution":
        dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        return conv_axis_role(axis, dn.output_batch_dimension)
    lb, lc, rb, rc = dot_dims(op)
    n_lhs = len(shape_of(op.operands[0]))
    return dot_axis_role(axis, len(lb), n_lhs - len(lb) - len(lc))


def root_shapes(op) -> tuple:
    """The shapes of a root's two operands and its result (read once per pass)."""
    return op_fact("shapes", op.operation, _root_shapes)


def _root_shapes(op) -> tuple:
    return shape_of(op.operands[0]), shape_of(op.operands[1]), shape_of(op.results[0])


def root_info(op):
    """The :class:`~hlofold._fold.core.patterns.RootInfo` of a convolution or dot (the type
    the jaxpr patterns' ``inspect_root`` gives), or a reason."""
    name = op_name(op)
    lhs, rhs, out = root_shapes(op)
    if name == "stablehlo.convolution":
        dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        layout = conv_layout(
            (dn.input_batch_dimension, dn.input_feature_dimension, *dn.input_spatial_dimensions),
            (dn.kernel_output_feature_dimension, dn.kernel_input_feature_dimension,
             *dn.kernel_spatial_dimensions),
            (dn.output_batch_dimension, dn.output_feature_dimension,
             *dn.output_spatial_dimensions))
        groups = (ir.IntegerAttr(op.attributes["feature_group_count"]).value
                  if "feature_group_count" in op.attributes else 1)
        return _root(out, dn.output_feature_dimension, 1, dn.kernel_output_feature_dimension,
                     layout, int(lhs[dn.input_feature_dimension]), int(groups))
    lb, lc, rb, rc = dot_dims(op)
    lfree = [d for d in range(len(lhs)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs)) if d not in rb + rc]
    if len(rfree) != 1 and (not rfree or len(lfree) == 1):
        return Reason("root", f"the rhs has {len(rfree)} free dimensions")
    # several free dimensions on both sides (a multi-head projection): the block of them
    # (contiguous in the kernel), else the rhs's first, as on jaxprs
    # (``_fold.jaxpr.patterns.DotAffinePattern``)
    block = block_of(rhs, rfree, len(lb) + len(lfree))
    if block is not None:
        return _root(out, block[0], 1, block[1], dot_layout(lhs, rhs, out),
                     math.prod(lhs[d] for d in lc), 1)
    return _root(out, len(lb) + len(lfree), 1, rfree[0], dot_layout(lhs, rhs, out),
                 math.prod(lhs[d] for d in lc), 1)


def _root(out_shape, axis, kernel_index, kernel_axis, layout, in_channels, groups) -> RootInfo:
    return RootInfo(axis, kernel_index, kernel_axis, layout, int(in_channels),
                    channel_count(out_shape, axis), int(groups))


def output_dims(op, kernel_index: int) -> int:
    """How many output (free) dimensions the weight operand of a root has (1 for a conv)."""
    if op_name(op) not in DOTS:
        return 1
    lb, lc, rb, rc = dot_dims(op)
    own = (rb, rc) if kernel_index == 1 else (lb, lc)
    return len(root_shapes(op)[kernel_index]) - len(own[0]) - len(own[1])


def dot_dims(op) -> tuple[tuple[int, ...], ...]:
    """(lhs batch, lhs contracting, rhs batch, rhs contracting) dimensions of a
    ``stablehlo.dot_general``, or of a ``stablehlo.dot`` (a matrix/vector product: the lhs's
    last dimension contracts with the rhs's first)."""
    return op_fact("dot_dims", op.operation, _dot_dims)      # (tuples: shared, read-only)


def _dot_dims(op) -> tuple:
    if op_name(op) == "stablehlo.dot":
        return (), (len(shape_of(op.operands[0])) - 1,), (), (0,)
    dn = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    return (tuple(dn.lhs_batching_dimensions), tuple(dn.lhs_contracting_dimensions),
            tuple(dn.rhs_batching_dimensions), tuple(dn.rhs_contracting_dimensions))


def lhs_root_info(op):
    """The weight as the lhs of a dot (its free dimensions are the output features: their
    block where contiguous, else the first, as on jaxprs), tried when the rhs reading folds
    nothing or reads an activation as its kernel; None for convolutions."""
    if op_name(op) not in DOTS:
        return None
    lb, lc, rb, rc = dot_dims(op)
    lhs, rhs, out = root_shapes(op)
    lfree = [d for d in range(len(lhs)) if d not in lb + lc]
    if not lfree or not is_float(op.operands[0]) or any(d < 0 for d in lhs):
        return None
    block = block_of(lhs, lfree, len(lb))
    if block is not None:
        return _root(out, block[0], 0, block[1], dot_layout(lhs, rhs, out, True),
                     math.prod(lhs[d] for d in lc), 1)
    return _root(out, len(lb), 0, lfree[0], dot_layout(lhs, rhs, out, True),
                 math.prod(lhs[d] for d in lc), 1)
