"""Parallel branches merged on StableHLO: the rule of ``_fold.core.merge`` read from ops.

The StableHLO twin of ``_fold.jaxpr.merge``: after the pass folded each branch's BatchNorm, a
tree of ``stablehlo.add`` whose leaves read one input ``x`` — ``convolution(x, K)`` with the
affine after it (a folded site's ``+ t``, the arithmetic or ``batch_norm_inference`` of an
identity branch), an average pool (``reduce_window`` of ``add``, then ``/ n``), a 1×1 → k×k
pair, ``x`` itself — is read into the core's terms, planned by the core
(:func:`hlofold._fold.core.merge.plan`) and rewritten as one ``convolution`` (attributes of the
largest branch's) plus the summed bias. Weights must be known (constants, or bound with
``params=``); a sum of branches whose weights are module arguments is refused with the
reason (``weights-not-known``). A per-channel affine after the whole sum (:func:`after_of`:
a BatchNorm of the block's output) is read for the merge to absorb.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._fold.core import merge as M
from hlofold._fold.core.chain import Absorb
from hlofold._base.chain_rules import Refusal
from hlofold._base.reasons import Reason
from hlofold._ir.stablehlo.build import GUARD, marked
from .forward import op_ints
from hlofold._ir.stablehlo.ir import BINARY, op_name, owner_op, shape_of
from .match import HLO_STEPS
from .patterns import SHAPE_STEPS, resolve

ir, stablehlo, _ = C.mlir()

CONV, _POOL = "stablehlo.convolution", "stablehlo.reduce_window"
_BN = "stablehlo.batch_norm_inference"
_AFFINE = ops.names(lambda o: o.affine is not None)
# elementwise nonlinearities a branch may end in (refused with that reason)
NONLINEAR = ops.names(lambda o: o.activation)


def single(v) -> bool:
    u = list(v.uses)
    return len(u) == 1 and op_name(u[0].owner) != "func.return"


def _param_like(v, shape) -> bool:
    own = shape_of(v)
    if sum(d != 1 for d in own) >= 2:       # no shape op to walk back through: it varies
        op = owner_op(v)                    # along two axes (``resolve``'s answer, cheaply)
        if op is None or op_name(op) not in SHAPE_STEPS:
            return False
    return not own or any(
        not isinstance(resolve(v, shape, ax, explain=False), Refusal)
        for ax in range(len(shape)) if shape[ax] != 1)


def walk_back(v):
    chain = []
    while (op := owner_op(v)) is not None and op_name(op) in _AFFINE:
        shape = shape_of(op.results[0])
        if op_name(op) in BINARY:
            p = [_param_like(o, shape) for o in op.operands]
            if p.count(False) != 1:
                break
            pos = p.index(False)
        else:
            pos = 0
        if shape_of(op.operands[pos]) != shape:
            break
        chain.append((op, pos))
        v = op.operands[pos]
        if not single(v):
            break
    return v, chain


def walk_forward(v):
    """From ``v`` forward through affine ops that read it alone (each value read once):
    ``[(op, operand position)]`` in program order, as far as they go."""
    chain = []
    shape, etype = shape_of(v), v.type
    while single(v):
        op = next(iter(v.uses)).owner
        name = op_name(op)
        if name not in _AFFINE or len(op.results) != 1 or op.results[0].type != etype:
            break
        if name in BINARY:
            pos = [i for i, o in enumerate(op.operands) if o == v]
            if len(pos) != 1 or not _param_like(op.operands[1 - pos[0]], shape):
                break
            pos = pos[0]
        elif op.operands[0] == v:
            pos = 0
        else:
            break
        chain.append((op, pos))
        v = op.results[0]
    return chain


def _is_pool(op, ev) -> bool:
    body = op.regions[0].blocks[0]
    ops = [op_name(o) for o in body.operations]
    init = ev(op.operands[1]) if len(op.operands) == 2 else None
    return ops == ["stablehlo.add", "stablehlo.return"] and init is not None and \
        not np.any(init)


def read(v, ev) -> M.Leaf:
    base_v, chain = walk_back(v)
    op = owner_op(base_v)
    name = op_name(op) if op is not None else None
    if name == CONV or (name == _POOL and _is_pool(op, ev)):
        if not single(base_v):
            return M.Leaf("shared", op.operands[0], v, op, chain)
        t = M.Leaf("conv" if name == CONV else "pool", op.operands[0], v, op, chain)
        mid, chain1 = walk_back(op.operands[0])
        o1 = owner_op(mid)
        if o1 is not None and op_name(o1) == CONV and single(mid) and \
                single(op.operands[0]):
            t.first = M.Leaf("conv", o1.operands[0], op.operands[0], o1, chain1)
        return t
    if op is not None and marked(op, GUARD):      # a folded site's run-time guard
        inside, convs = set(), []
        for region in op.regions:
            for block in region.blocks:
                inside.update(block.arguments)
                for inner in block.operations:
                    inside.update(inner.results)
                    if op_name(inner) == CONV:
                        convs.append(inner)
        for inner in convs:
            if inner.operands[0] not in inside:
                return M.Leaf("guarded", inner.operands[0], v, inner, chain)
    if op is not None and len(op.results) == 1 and name in NONLINEAR:
        shape = shape_of(op.results[0])
        acts = [o for o in op.operands if shape_of(o) == shape and not _param_like(o, shape)]
        if len(acts) == 1 and name not in (CONV, _POOL):
            u, _ = walk_back(acts[0])
            c = owner_op(u)
            if c is not None and op_name(c) == CONV:
                return M.Leaf("identity", base_v, v, None, chain, alt=(c.operands[0], op))
    return M.Leaf("identity", base_v, v, None, chain)


def specs(op):
    dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    return ((dn.input_batch_dimension, dn.input_feature_dimension, *dn.input_spatial_dimensions),
            (dn.kernel_output_feature_dimension, dn.kernel_input_feature_dimension,
             *dn.kernel_spatial_dimensions),
            (dn.output_batch_dimension, dn.output_feature_dimension,
             *dn.output_spatial_dimensions))


def _int_attr(op, name, default=1) -> int:
    return ir.IntegerAttr(op.attributes[name]).value if name in op.attributes else default


def window(op, lhs_spec) -> M.Window | None:
    if op_name(op) == CONV:
        ls, rs, os_ = specs(op)
        if tuple(ls) != tuple(lhs_spec):
            return None
        n = len(ls) - 2
        pad = op_ints(op, "padding", [0] * (2 * n))
        rhs, lhs = shape_of(op.operands[1]), shape_of(op.operands[0])
        return M.Window(tuple(rhs[d] for d in rs[2:]),
                        tuple(op_ints(op, "window_strides", [1] * n)),
                        tuple(zip(pad[0::2], pad[1::2])),
                        tuple(op_ints(op, "rhs_dilation", [1] * n)),
                        tuple(op_ints(op, "lhs_dilation", [1] * n)),
                        _int_attr(op, "feature_group_count"), int(lhs[ls[1]]),
                        int(shape_of(op.results[0])[os_[1]]),
                        _int_attr(op, "batch_group_count"))
    r = len(shape_of(op.operands[0]))
    wd = op_ints(op, "window_dimensions")
    st = op_ints(op, "window_strides", [1] * r)
    pad = op_ints(op, "padding", [0] * (2 * r))
    pad = list(zip(pad[0::2], pad[1::2]))
    return M.pool_window(wd, st, pad, op_ints(op, "base_dilations", [1] * r),
                         op_ints(op, "window_dilations", [1] * r), lhs_spec,
                         int(shape_of(op.operands[0])[lhs_spec[1]]))


NOT_MERGED = {**M.NOT_MERGED, "guarded": Reason(
    "weights-not-known", "the branches' weights are module arguments, folded in the graph "
    "under run-time guards; they merge with their values (fold_stablehlo(..., params=), "
    "hlofold fold --params)")}
WEIGHTS_ARGS = Reason("weights-not-known", "the branches' weights are module arguments; they merge "
               "with their values (fold_stablehlo(..., params=), hlofold fold --params)")


def chain_steps(chain, axis):
    """The steps of a branch's chain (``walk_back``'s, read in program order); None where
    one is not per channel along ``axis``."""
    steps, ops = _prefix(chain[::-1], axis)
    return steps if len(steps) == len(chain) else None


def _prefix(chain, axis) -> tuple[list, list]:
    """The per-channel steps of ``chain`` (program order) as far as they go, and their ops."""
    steps, ops = [], []
    for op, pos in chain:
        r = HLO_STEPS[op_name(op)](None, op, pos, op.operands[pos], axis)
        if not isinstance(r, Absorb):
            break
        steps.append(r.step)
        ops.append(op)
    return steps, ops


@dataclasses.dataclass
class After:
    """The per-channel affine after a sum: its steps and ops; the sum's bias terms (atom
    index, operand), which a staged merge adds to its bias before the affine."""

    steps: list
    ops: list
    biases: list


def after_of(top, atoms, groups, leaves, vals, staged) -> After | None:
    """The per-channel affine after the sum ``top`` when the sum is one group of branches
    and per-channel biases alone (known ones, unless staged); else None."""
    if len(groups) != 1:
        return None
    rest = [(k, a) for k, a in enumerate(atoms) if k not in groups[0]]
    target = next((leaves[k].base for k in groups[0] if leaves[k].kind in (
        "conv", "pair", "guarded") and op_name(leaves[k].base) == CONV), None)
    if target is None:
        return None
    axis, shape = specs(target)[2][1], shape_of(top.results[0])
    biases = []
    for k, a in rest:
        r = resolve(a, shape, axis, explain=False)
        if r is None or isinstance(r, Refusal) or (not staged and vals.operand_np(r) is None):
            return None
        biases.append((k, r))
    steps, ops = _prefix(walk_forward(top.results[0]), axis)
    return After(steps, ops, biases) if steps else None
