"""Planning a forward fold on StableHLO: the affine chain *in front of* a root.

The StableHLO side of ``_fold.jaxpr.forward``: ``root(x·s + t, K) = root(x, K ⊙_in s) + root(t, K)``
for ``s``/``t`` per input feature. The chain is the shared walk
``_fold.core.forward_walk.walk_forward`` (per-channel steps of ``_fold.stablehlo.match.HLO_STEPS``; LayerNorm's
and RMSNorm's per-token factors, kept in the graph) over :class:`HloForwardIR`, with the
rules both paths share:

* a value before the root has one reader; the root's input may feed several roots when
  every one of them is a linear layer reading it as its input features;
* an operand is not computed from the activations (a root's output, or the values the
  chain itself is computed from: a statistic of the token);
* a shift the padding hides from some taps becomes a bias map (``_fold.core.patterns.border_masks``,
  ``_fold.core.patterns.bias_map``), refused where it costs more than it saves
  (``_fold.core.rules.bias_map_refusal``);
* an op an earlier root's chain took is not taken again (one op, one owner).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._base.algebra import has_shift
from hlofold._fold.core.chain import Absorb
from hlofold._base.chain_rules import Block, Refusal
from hlofold._fold.core.decide import forward_consumers_refusal, forward_note, multi_output_shift
from hlofold._fold.core.forward_walk import PASS, walk_forward
from hlofold._ir.stablehlo.build import GUARD, marked
from hlofold._ir.stablehlo.ir import (ROOTS, SHAPE_KIND, attr_dims, is_float, location,
                                      op_name, owner_op, parent_of, readers, same_block, shape_of)
from .match import HLO_STEPS
from .patterns import Step, dot_dims, output_dims, resolve
from hlofold._fold.core.patterns import border_masks
from hlofold._base.reasons import Reason
from hlofold._base.report import FOLDED, REFUSED, FoldSite
from hlofold._fold.core.rules import WEIGHT_CONE, bias_map_refusal, weight_like
from hlofold._base.channel_axes import back_through_shape

ir, stablehlo, func_dialect = C.mlir()

_AFFINE = ops.names(lambda o: o.affine is not None)
# (the same values: the root reads them constrained again)
_PASS = ops.names(lambda o: o.shape in ("constraint", "copy"))
# shape ops a forward chain passes next to the root where they keep the channels whole
_MOVES = ops.OPS.kinds("shape", {k: k for k in ("reshape", "squeeze", "expand", "broadcast")})
_KINDS = {**ops.OPS.kinds("affine", {k: k for k in ("add", "sub", "mul", "div", "neg")}),
          **ops.OPS.kinds("shape", {"broadcast": "broadcast_in_dim"})}
# ops computing each element from the same element of their operands (per-token stays so)
_ELEMENTWISE = ops.names(lambda o: o.elementwise)
# producers an elementwise consumer is not fused into: the affine in front is a pass of its own
_OWN_PASS = ops.names(lambda o: o.opaque)


@dataclasses.dataclass
class HloForward:
    """An affine chain in front of a root: ``root(x·s + t, K) = root(x, K ⊙ s) + b``."""

    steps: list                  # _hlo_patterns.Step, in program order
    source: Any                  # x: the value before the chain
    k_in_axis: int               # kernel axis contracted with the input features
    groups: int
    record: FoldSite
    act: int                     # the root's operand that reads the chain
    # per-token ops the root's input keeps, in program order: ("mul", r) or ("add", u)
    tokens: list = dataclasses.field(default_factory=list)
    masks: list | None = None    # per spatial dimension, the taps that read the input
    taken: list = dataclasses.field(default_factory=list)   # the ops the chain took
    passes: list = dataclasses.field(default_factory=list)  # sharding constraints replayed
    s_known: np.ndarray | None = None
    t_known: np.ndarray | None = None

    @property
    def has_shift(self) -> bool:
        return has_shift(self.steps)


def input_feature_axis(root, act: int) -> int | None:
    """The input-feature axis of the root's operand ``act`` (the activations), if any."""
    if op_name(root) == "stablehlo.convolution":
        if act != 0:
            return None
        return stablehlo.ConvDimensionNumbers(
            root.attributes["dimension_numbers"]).input_feature_dimension
    contracting = dot_dims(root)[1 if act == 0 else 3]
    return contracting[0] if len(contracting) == 1 else None


def input_channel(root, act: int) -> tuple[int, int] | Refusal:
    """(activation feature axis, kernel input-feature axis), or why not (the words of
    ``_fold.core.patterns``' ``input_channel``)."""
    if op_name(root) == "stablehlo.convolution":
        if "batch_group_count" in root.attributes and \
                ir.IntegerAttr(root.attributes["batch_group_count"]).value != 1:
            return Refusal("batch_group_count > 1", kind="root")
        if any(op_ints(root, "window_reversal")):
            return Refusal("a convolution with window reversal", kind="root")
        dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
        return dn.input_feature_dimension, dn.kernel_input_feature_dimension
    lb, lc, rb, rc = dot_dims(root)
    if lb:
        return Refusal("dot with batch dimensions", kind="root")
    if len(lc) != 1:
        return Refusal(f"dot contracting {len(lc)} dimensions", kind="root")
    return (lc[0], rc[0]) if act == 0 else (rc[0], lc[0])


def op_ints(op, name, default=None) -> list:
    if name not in op.attributes:
        return list(default or [])
    attr = op.attributes[name]
    if name == "padding":
        return [int(v) for v in ir.DenseIntElementsAttr(attr)]
    return [int(v) for v in (ir.DenseBoolArrayAttr(attr) if name == "window_reversal"
                             else ir.DenseI64ArrayAttr(attr))]


def conv_masks(root) -> list | None | Refusal:
    """:func:`hlofold._fold.core.patterns.border_masks` of a ``stablehlo.convolution``."""
    if op_name(root) != "stablehlo.convolution":
        return None
    dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
    lhs, rhs, out = (shape_of(v) for v in (root.operands[0], root.operands[1],
                                            root.results[0]))
    n = len(dn.input_spatial_dimensions)
    pad = op_ints(root, "padding", [0] * (2 * n))
    return border_masks([lhs[d] for d in dn.input_spatial_dimensions],
                        [rhs[d] for d in dn.kernel_spatial_dimensions],
                        [out[d] for d in dn.output_spatial_dimensions],
                        op_ints(root, "window_strides", [1] * n), pad[0::2],
                        op_ints(root, "lhs_dilation", [1] * n),
                        op_ints(root, "rhs_dilation", [1] * n))


def conv_specs(root) -> tuple[tuple, tuple]:
    """The kernel's (O, I, spatial...) and the output's (N, C, spatial...) axes."""
    dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
    return ((dn.kernel_output_feature_dimension, dn.kernel_input_feature_dimension,
             *dn.kernel_spatial_dimensions),
            (dn.output_batch_dimension, dn.output_feature_dimension,
             *dn.output_spatial_dimensions))


def _distinct(readers) -> int:
    return len({op.operation for op, _ in readers})


def _elems(shape, skip: int | None = None) -> int:
    return math.prod(d for a, d in enumerate(shape) if a != skip)


class HloForwardPlanner:
    """The forward-chain half of the StableHLO pass (``_fold.stablehlo.fold._Pass``)."""

    def plan_forward(self, root, info, fname) -> HloForward | None:
        """Follow the root's activation operand back through per-input-channel affine ops.
        Returns the forward fold, or None (no chain, or refused: then recorded)."""
        act = 1 - info.kernel_index
        axis = input_feature_axis(root, act)
        if axis is None:
            return None
        top = root.operands[act]
        kind = "conv" if op_name(root) == "stablehlo.convolution" else "dot"
        pattern = f"stablehlo_affine_{kind}"
        chain = self._walk_forward(root, top, axis)
        if isinstance(chain, Reason):
            self._record(root, fname, REFUSED, info, pattern=pattern, reason=chain)
            return None
        v, steps, reason = chain.source, chain.steps, chain.stop
        self.forward_taken.update(o.operation for o in chain.taken)
        if not steps:
            if reason is not None:
                self._record(root, fname, REFUSED, info, pattern=pattern, reason=reason)
            return None
        absorbed = [op_name(s.op).split(".")[-1] for s in steps]
        ic = input_channel(root, act)
        masks = conv_masks(root) if has_shift(steps) else None
        why = next((r.reason for r in (ic, masks) if isinstance(r, Refusal)), None) or \
            multi_output_shift(has_shift(steps), output_dims(root, info.kernel_index),
                               isinstance(info.kernel_axis, Block))
        if why is None and masks is not None:
            batch = stablehlo.ConvDimensionNumbers(
                root.attributes["dimension_numbers"]).output_batch_dimension
            why = bias_map_refusal(_elems(shape_of(root.results[0]), batch),
                                   _elems(shape_of(v)), self._fused_with(v))
        if why:
            self._record(root, fname, REFUSED, info, pattern=pattern, absorbed=absorbed,
                         reason=why)
            return None
        rec = self._record(root, fname, FOLDED, info, pattern=pattern, absorbed=absorbed)
        rec.note = forward_note(len(chain.tokens), self._n_top_readers(chain, top),
                                masks is not None, reason)
        return HloForward(steps, v, ic[1], info.groups, rec, act, tokens=chain.tokens,
                          passes=chain.passes,
                          masks=masks, taken=chain.taken)

    def _walk_forward(self, root, top, axis: int):
        """``walk_forward`` from ``top``, once for the roots reading it (Q, K, V; gate, up):
        the walk reads the program as written, so it finds the same chain for each, unless
        an op it took has since been claimed by an earlier root's chain (then walked again)."""
        key = (top, axis, parent_of(root))
        chain = self.forward_memo.get(key)
        if chain is None or any(o.operation in self.claimed for o in chain.taken):
            chain = walk_forward(HloForwardIR(self, root), top, axis)
            if not isinstance(chain, Reason):
                self.forward_memo[key] = chain
        return chain

    def shared_by_chain(self, steps) -> dict:
        """What is worked out once for the roots sharing a walked forward chain (Q, K, V;
        gate, up): a dict per chain, keyed by its steps (one list for those roots, held here
        with its dict, so no other list gets its id); dropped with the chain memo."""
        return self.chain_shared.setdefault(id(steps), (steps, {}))[1]

    def _n_top_readers(self, chain, top) -> int:
        """:meth:`n_readers` of ``top``, once for the roots sharing its walked chain (the
        program as written: the ops folds write are not readers)."""
        shared = self.shared_by_chain(chain.steps)
        if "readers" not in shared:
            shared["readers"] = self.n_readers(top)
        return shared["readers"]

    def _readers(self, v) -> list:
        """The ops reading ``v`` in the program as written (the jaxpr path plans on the
        original equations): ``_ir.stablehlo.ir.readers`` but for the ops folds wrote (their roots,
        per-token ops, guards and the original ops a guard holds)."""
        written = self.written

        def skip(op):        # (a guard is a stablehlo.if: other ops are not asked)
            op = op.operation
            if op in written or op.name == "stablehlo.if" and marked(op, GUARD):
                return True
            parent = op.parent
            return parent is not None and parent.name == "stablehlo.if" and \
                marked(parent, GUARD)
        return readers(v, skip)

    def n_readers(self, v) -> int:
        """Ops reading ``v`` (one reading it twice, ``multiply(x, x)``, counts once)."""
        return _distinct(self._readers(v))

    def _consumers_refusal(self, v, top, axis: int) -> str | None:
        """None if the chain may take the op producing ``v``
        (``_fold.core.decide.forward_consumers_refusal``)."""
        got = self._readers(v)

        def readers():
            for o, pos in got:
                name = op_name(o)
                linear = (name in ROOTS and sum(1 for w in o.operands if w == v) == 1
                          and input_feature_axis(o, pos) == axis
                          and not isinstance(input_channel(o, pos), Refusal))
                file, line, _ = location(o) if not linear else (None, None, None)
                yield name, name in ROOTS, linear, pos, file, line
        returned = any(op_name(o) == "func.return" for o, _ in got)
        return forward_consumers_refusal(_distinct(got), v == top, "function" if returned else None,
                                         readers())

    def weight_like(self, root, k: int) -> bool:
        """Operand ``k`` of ``root`` is the weight, not yet known (``_fold.core.rules.weight_like``)."""
        def kinds(v):
            cone = self._cone(v, WEIGHT_CONE)
            return None if cone is None else [
                SHAPE_KIND.get(op_name(o), op_name(o)) for o in map(owner_op, cone)
                if o is not None]
        w = root.operands[k]
        return weight_like(lambda: kinds(w), owner_op(w) is not None and self._from_root(w),
                           lambda: kinds(root.operands[1 - k]))

    def _cone(self, value, limit: int) -> set | None:
        """The values ``value`` is computed from (itself included), or None beyond
        ``limit`` ops."""
        seen, stack, n = {value}, [value], 0
        while stack:
            op = owner_op(stack.pop())
            if op is None:
                continue
            n += 1
            if n > limit:
                return None
            for w in op.operands:
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        return seen

    def is_activation(self, operand, chain_value) -> bool:
        """Whether ``operand`` is computed from the activations: from a root's output, or
        from an argument the chain value is computed from too (a statistic of the token).
        Constants link nothing. No bound: each op's sources are found once."""
        if owner_op(operand) is not None and self._from_root(operand):
            return True
        return bool(self._sources(operand) & self._sources(chain_value))

    def _sources(self, value) -> int:
        """The block arguments (the module's inputs, a region's arguments) ``value`` is
        computed from, as a bit set (its lineage without the activation bit)."""
        return self._lineage(value) >> 1

    def _fused_with(self, v) -> str | None:
        """The op producing ``v`` when XLA computes an elementwise consumer of ``v`` in the
        same loop: anything but an argument, a root or control flow (a private callee is
        inlined by XLA: its op counts)."""
        for _ in range(8):
            op = owner_op(v)
            if op is None:
                return None
            name = self.replaced.get(op.operation) or op_name(op)
            if name != "func.call":
                return None if name in _OWN_PASS else name.split(".")[-1]
            callee = self.symbols.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
            if callee is None or not callee.regions[0].blocks:
                return None
            ret = list(callee.regions[0].blocks[0].operations)[-1]
            v = ret.operands[list(op.results).index(v)]
        return None


class HloForwardIR:
    """The StableHLO adapter of the forward walk (``_fold.core.forward_walk.ForwardIR``), for one
    root."""

    def __init__(self, planner: HloForwardPlanner, root):
        self.p, self.root = planner, root
        self.invariant_memo = planner.invariant_memo       # shared by the pass's roots

    def producer(self, value):
        return owner_op(value)

    def takeable(self, op) -> bool:
        # (a value from outside the root's region ends the chain: as on a jaxpr, where a
        # nested jaxpr's input has no producer)
        name = op_name(op)
        return (name in _AFFINE or name in _PASS or name in _MOVES) and \
            op.operation not in self.p.claimed and is_float(op.results[0]) and \
            same_block(op, self.root)

    def pass_axis(self, op, axis: int):
        name = op_name(op)
        if name in _PASS:
            return axis
        if name not in _MOVES or len(op.operands) != 1:
            return None
        dims = attr_dims(op, "broadcast_dimensions") if _MOVES[name] == "broadcast" else None
        return back_through_shape(_MOVES[name], shape_of(op.operands[0]),
                                  shape_of(op.results[0]), axis, dims)

    def kind(self, op) -> str:
        name = op_name(op)
        if name in _PASS:
            return PASS
        if name in _KINDS:
            return _KINDS[name]
        return "elementwise" if name in _ELEMENTWISE else "other"

    def operands(self, op) -> list:
        return list(op.operands)

    def result(self, op):
        return op.results[0]

    def shape(self, value):
        memo = self.p.shape_memo            # (the walks ask of a value several times)
        got = memo.get(value)
        if got is None:
            got = memo[value] = shape_of(value)
        return got

    def broadcast_dims(self, op) -> tuple:
        return tuple(attr_dims(op, "broadcast_dimensions"))

    def affine(self, op, pos: int, axis: int):
        if op_name(op) not in _AFFINE:       # (a shape op pass_axis did not pass)
            return None
        got = HLO_STEPS[op_name(op)](None, op, pos, op.operands[pos], axis)
        return (got.step, got.source) if isinstance(got, Absorb) else None

    def channel(self, value, shape, axis: int):
        got = resolve(value, shape, axis)
        return None if isinstance(got, Refusal) else (got, got.value)

    def step(self, op, kind: str, operand, axis: int):
        return Step(op, kind, operand, axis=axis)

    def known(self, value) -> bool:
        return self.p.eval(value) is not None

    def is_activation(self, source, chain_value) -> bool:
        return self.p.is_activation(source, chain_value)

    def consumers_refusal(self, value, top, axis: int):
        return self.p._consumers_refusal(value, top, axis)

    def n_consumers(self, value) -> int:
        return self.p.n_readers(value)
