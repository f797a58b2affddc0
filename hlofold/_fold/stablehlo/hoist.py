"""What a loop body computes from the weights alone, hoisted into a loop of its own.

A scanned stack folded in the graph (``split=``: the weights are arguments, nothing known)
computes ``K ⊙ s`` of one layer's slices on every iteration. :func:`hoist_prepared` moves
those computations — the values marked ``PREPARED`` and what computes them from the loop's
invariant operands and counters — into a loop before it that fills one stack per value
(``dynamic_update_slice`` at the iteration number), once per call of the module; the body
reads its row instead. ``split`` then puts that loop on the prepare side.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo.build import PREPARED, int_constant, make, mark, marked, unmark
from hlofold._ir.stablehlo.ir import numpy_to_dense, owner_op, shape_of
from .loops import Loop, clone, row_of
from hlofold._ir.stablehlo.module import erase_unused

ir, stablehlo, func_dialect = C.mlir()


def hoist_prepared(w, loop: Loop, fop) -> list:
    """Move what layer 0's body (``fop``, folded in the graph) computes from the weights
    alone — the values marked ``PREPARED`` and what computes them from the loop-invariant
    operands and the counters — into a loop of its own before ``w`` that fills one stack
    per value (``dynamic_update_slice`` at the iteration number); the body reads a new
    argument (after its own) at the row instead. Returns the stacks (each through an op
    marked ``PREPARED``: ``split=`` checks them once), the outer values of those arguments."""
    entry = fop.regions[0].blocks[0]
    pure = {entry.arguments[k] for k in (*loop.invariant, *loop.counters)}
    ops = list(entry.operations)[:-1]
    for op in ops:
        if not len(op.regions) and all(v in pure for v in op.operands):
            pure.update(op.results)
    preps = [op for op in ops if marked(op, PREPARED) and op.results[0] in pure]
    if not preps:
        return []
    need, todo = set(), [p.operation for p in preps]
    while todo:
        op = todo.pop()
        if op in need:
            continue
        need.add(op)
        todo += [o.operation for v in op.operands if (o := owner_op(v)) is not None]
    part = [op for op in ops if op.operation in need]
    used = [k for k in sorted(loop.invariant) if any(
        v == entry.arguments[k] for op in part for v in op.operands)]
    rt = ir.RankedTensorType(entry.arguments[loop.row].type)
    L = loop.length
    outs = [ir.RankedTensorType.get([L] + list(shape_of(p.results[0])),
                                    ir.RankedTensorType(p.results[0].type).element_type)
            for p in preps]
    with ir.InsertionPoint(w):
        init = [int_constant(rt, 0)] + [w.operands[k] for k in used] + [
            make("stablehlo.broadcast_in_dim", [t], [stablehlo.ConstantOp(
                numpy_to_dense(np.zeros((), np.float32), t.element_type)).result],
                {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([])}).result for t in outs]
        types = [v.type for v in init]
        pw = make("stablehlo.while", types, init, regions=2)
    cb = pw.regions[0].blocks.append(*types)
    with ir.InsertionPoint(cb):
        make("stablehlo.return", [], [stablehlo.CompareOp(
            cb.arguments[0], int_constant(rt, L),
            stablehlo.ComparisonDirectionAttr.get("LT")).result])
    bb = pw.regions[1].blocks.append(*types)
    row = bb.arguments[0]
    mapping = {entry.arguments[k]: bb.arguments[1 + i] for i, k in enumerate(used)}
    with ir.InsertionPoint(bb):
        zero = int_constant(rt, 0)
        for k, (a, c) in loop.counters.items():   # each counter read, from the iteration
            if not any(v == entry.arguments[k] for op in part for v in op.operands):
                continue
            ct = ir.RankedTensorType(entry.arguments[k].type)
            mapping[entry.arguments[k]] = row if (a, c, ct) == (0, 1, rt) else \
                stablehlo.AddOp(stablehlo.MulOp(stablehlo.ConvertOp(ct, row).result,
                                                int_constant(ct, c)).result,
                                int_constant(ct, a)).result
        clone(part, mapping, {})
        for op in bb.operations:
            if marked(op, PREPARED):       # (checked once, on the stacks below)
                unmark(op, PREPARED)
        upd = []
        for j, p in enumerate(preps):
            v = mapping[p.results[0]]
            one = ir.RankedTensorType.get([1] + list(shape_of(v)), outs[j].element_type)
            upd.append(make("stablehlo.dynamic_update_slice", [outs[j]], [
                bb.arguments[1 + len(used) + j], make("stablehlo.reshape", [one], [v]).result,
                row] + [zero] * len(shape_of(v))).result)
        make("stablehlo.return", [], [stablehlo.AddOp(row, int_constant(rt, 1)).result] +
             list(bb.arguments[1:1 + len(used)]) + upd)
    stacks = []
    with ir.InsertionPoint(w):
        for j in range(len(preps)):
            cv = stablehlo.ConvertOp(outs[j], pw.results[1 + len(used) + j])
            mark(cv, PREPARED)
            stacks.append(cv.result)
    # the body reads its row of each stack instead
    with ir.InsertionPoint.at_block_begin(entry):
        zero = int_constant(rt, 0)
    for j, p in enumerate(preps):
        arg = entry.add_argument(outs[j], ir.Location.unknown())
        with ir.InsertionPoint(p):
            p.results[0].replace_all_uses_with(row_of(arg, entry.arguments[loop.row], zero))
    erase_unused(preps)
    return stacks
