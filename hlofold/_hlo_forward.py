"""Planning a forward fold on StableHLO: the affine chain *in front of* a root.

The StableHLO side of ``_jaxpr_forward``: ``root(x·s + t, K) = root(x, K ⊙_in s) + root(t, K)``
for ``s``/``t`` per input feature. The chain is walked back from the root's activation
operand through the per-channel steps of ``_hlo_match.HLO_STEPS`` (add, subtract, multiply,
divide, negate), with the rules both paths share:

* a value before the root has one reader; the root's input may feed several roots when
  every one of them is a linear layer reading it as its input features;
* an operand is not computed from the activations (a root's output, or the values the
  chain itself is computed from: a statistic of the token);
* a shift the padding hides from some taps becomes a bias map (``_patterns.border_masks``,
  ``_patterns.bias_map``), refused where it costs more than it saves
  (``_rules.bias_map_refusal``);
* an op an earlier root's chain took is not taken again (one op, one owner).

Per-token factors (LayerNorm's ``rsqrt`` of a token's variance) are taken on the jaxpr path
only; here the chain stops at them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _compat as C
from ._algebra import has_shift
from ._chain import Absorb
from ._chain_rules import Refusal
from ._decide import forward_consumers_refusal, forward_note
from ._hlo_ir import (BINARY, GUARD_ATTR, ROOTS, is_float, location, op_name, owner_op,
                      parent_of, readers, same_block, shape_of)
from ._hlo_match import HLO_STEPS
from ._hlo_patterns import dot_dims
from ._patterns import border_masks
from ._reasons import Reason
from ._report import FOLDED, REFUSED, FoldSite
from ._rules import bias_map_refusal

ir, stablehlo, func_dialect = C.mlir()

_AFFINE = frozenset(BINARY) | {"stablehlo.negate"}
_CONE_LIMIT = 256          # ops looked at per ancestry question (beyond: "activation")
# producers an elementwise consumer is not fused into: the affine in front is a pass of its own
_OWN_PASS = frozenset({*ROOTS, "stablehlo.while", "stablehlo.if", "stablehlo.case",
                       "stablehlo.custom_call", "stablehlo.sort"})


@dataclasses.dataclass
class HloForward:
    """An affine chain in front of a root: ``root(x·s + t, K) = root(x, K ⊙ s) + b``."""

    steps: list                  # _hlo_patterns.Step, in program order
    source: Any                  # x: the value before the chain
    k_in_axis: int               # kernel axis contracted with the input features
    groups: int
    record: FoldSite
    act: int                     # the root's operand that reads the chain
    masks: list | None = None    # per spatial dimension, the taps that read the input
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
    ``_patterns``' ``input_channel``)."""
    if op_name(root) == "stablehlo.convolution":
        if "batch_group_count" in root.attributes and \
                ir.IntegerAttr(root.attributes["batch_group_count"]).value != 1:
            return Refusal("batch_group_count > 1", kind="root")
        if any(_ints(root, "window_reversal")):
            return Refusal("a convolution with window reversal", kind="root")
        dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
        return dn.input_feature_dimension, dn.kernel_input_feature_dimension
    lb, lc, rb, rc = dot_dims(root)
    if lb:
        return Refusal("dot with batch dimensions", kind="root")
    if len(lc) != 1:
        return Refusal(f"dot contracting {len(lc)} dimensions", kind="root")
    return (lc[0], rc[0]) if act == 0 else (rc[0], lc[0])


def _ints(op, name, default=None) -> list:
    if name not in op.attributes:
        return list(default or [])
    attr = op.attributes[name]
    if name == "padding":
        return [int(v) for v in ir.DenseIntElementsAttr(attr)]
    return [int(v) for v in (ir.DenseBoolArrayAttr(attr) if name == "window_reversal"
                             else ir.DenseI64ArrayAttr(attr))]


def conv_masks(root) -> list | None | Refusal:
    """:func:`hlofold._patterns.border_masks` of a ``stablehlo.convolution``."""
    if op_name(root) != "stablehlo.convolution":
        return None
    dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
    lhs, rhs, out = (shape_of(v) for v in (root.operands[0], root.operands[1],
                                            root.results[0]))
    n = len(dn.input_spatial_dimensions)
    pad = _ints(root, "padding", [0] * (2 * n))
    return border_masks([lhs[d] for d in dn.input_spatial_dimensions],
                        [rhs[d] for d in dn.kernel_spatial_dimensions],
                        [out[d] for d in dn.output_spatial_dimensions],
                        _ints(root, "window_strides", [1] * n), pad[0::2],
                        _ints(root, "lhs_dilation", [1] * n),
                        _ints(root, "rhs_dilation", [1] * n))


def conv_specs(root) -> tuple[tuple, tuple]:
    """The kernel's (O, I, spatial...) and the output's (N, C, spatial...) axes."""
    dn = stablehlo.ConvDimensionNumbers(root.attributes["dimension_numbers"])
    return ((dn.kernel_output_feature_dimension, dn.kernel_input_feature_dimension,
             *dn.kernel_spatial_dimensions),
            (dn.output_batch_dimension, dn.output_feature_dimension,
             *dn.output_spatial_dimensions))


def _elems(shape, skip: int | None = None) -> int:
    return int(np.prod([d for a, d in enumerate(shape) if a != skip], dtype=np.int64))


class HloForwardPlanner:
    """The forward-chain half of the StableHLO pass (``_stablehlo._Pass``)."""

    def plan_forward(self, root, info, fname) -> HloForward | None:
        """Follow the root's activation operand back through per-input-channel affine ops.
        Returns the forward fold, or None (no chain, or refused: then recorded)."""
        act = 1 - info[1]
        axis = input_feature_axis(root, act)
        if axis is None:
            return None
        top = root.operands[act]
        v, steps, taken, reason = top, [], [], None
        while True:
            op = owner_op(v)
            if op is None or op_name(op) not in _AFFINE or op.operation in self.claimed or \
                    not is_float(op.results[0]) or not same_block(op, root):
                break            # (a value from outside the root's region: as on a jaxpr,
                # where a nested jaxpr's input has no producer, the chain stops there)
            why = self._consumers_refusal(v, top, axis)
            if why:
                reason = why
                break
            cands = []
            for pos, u in enumerate(op.operands):
                got = HLO_STEPS[op_name(op)](None, op, pos, u, axis)
                if isinstance(got, Absorb) and (got.source is None or
                                                not self._is_activation(got.source, u)):
                    cands.append((pos, got.step))
            if len(cands) > 1:        # a chain value is not known at transform time
                cands = [c for c in cands if self.eval(op.operands[c[0]]) is None]
            if len(cands) > 1:        # and is computed, where the operand is an input
                cands = [c for c in cands if owner_op(op.operands[c[0]]) is not None
                         and c[1].operand is not None
                         and owner_op(c[1].operand.value) is None]
            if len(cands) != 1:
                if len(cands) > 1:
                    reason = Reason("feature-axis", "both operands of the op before the root "
                                    "look per-channel")
                break
            pos, step = cands[0]
            steps.append(step)
            taken.append(op)
            v = op.operands[pos]
        self.forward_taken.update(o.operation for o in taken)
        kind = "conv" if op_name(root) == "stablehlo.convolution" else "dot"
        pattern = f"stablehlo_affine_{kind}"
        if not steps:
            if reason is not None:
                self._record(root, fname, REFUSED, info, pattern=pattern, reason=reason)
            return None
        steps.reverse()
        absorbed = [op_name(s.op).split(".")[-1] for s in steps]
        ic = input_channel(root, act)
        masks = conv_masks(root) if has_shift(steps) else None
        why = next((r.reason for r in (ic, masks) if isinstance(r, Refusal)), None)
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
        rec.note = forward_note(0, len(self._readers(top)), masks is not None, reason)
        groups = info[5]
        return HloForward(steps, v, ic[1], groups, rec, act, masks=masks)

    def _readers(self, v) -> list:
        """The ops reading ``v`` (``_hlo_ir.readers``), but for roots already replaced and the
        ops a site's guard holds (its original ops)."""
        def skip(op):
            parent = parent_of(op)
            return op.operation in self.dead_set or GUARD_ATTR in op.operation.attributes or \
                (parent is not None and GUARD_ATTR in parent.attributes)
        return readers(v, skip)

    def _consumers_refusal(self, v, top, axis: int) -> str | None:
        """None if the chain may take the op producing ``v``
        (``_decide.forward_consumers_refusal``)."""
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
        return forward_consumers_refusal(len(got), v == top, "function" if returned else None,
                                         readers())

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

    def _is_activation(self, operand, chain_value) -> bool:
        """Whether ``operand`` is computed from the activations: from a root's output, or
        from a value the chain value is computed from (a statistic of the token)."""
        if owner_op(operand) is not None and self._from_root(operand):
            return True
        cone = self._cone(operand, _CONE_LIMIT)
        if cone is None:
            return True
        chain = self._cone(chain_value, 4 * _CONE_LIMIT)
        # constants are shared freely (a jaxpr writes small ones as literals): not a link
        return chain is None or any(owner_op(w) is None or
                                    op_name(owner_op(w)) != "stablehlo.constant"
                                    for w in cone & chain)

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
