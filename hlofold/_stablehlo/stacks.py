"""Scanned layer stacks on the StableHLO path: a ``stablehlo.while`` reading known stacks.

``lax.scan`` over stacked parameters (``flax.linen.scan``, ``nnx.scan``, MaxText) and the
``fori_loop`` form ``params["K"][i]`` lower to a ``stablehlo.while`` whose loop-invariant
operands are the stacks, read in the body through ``dynamic_slice`` at a counter. Where those
operands are known (constants in the module, or bound by ``params=``) and the loop is a counted
one (a counter from a constant start by a constant step, the condition ``counter < bound``),
:func:`fold_stacks` folds the body once per layer as a module of its own (the body as ``@main``,
private callees inlined, the counters and the known operands given to the evaluator —
``patterns.Evaluator.bound``: the slices are read as views of the stacks, never copied), with
every rule of the pass (``fold_module``), and restacks the folded constants with the core rule
(``_core.stacks.Restack``): the new loop takes the folded kernels and biases as stacked
operands of its own, read at the iteration number, and its body runs conv + bias; the old
stacks it no longer reads are dropped. Layers that do not fold alike leave the loop as it was,
and the pass gives its sites that reason.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import _compat as C
from .._core.reasons import Reason
from .._core.report import FOLDED
from .._core.stacks import Restack, first_difference, layer_records, layers_differ
from .build import STACK, make, mark, marked
from .ir import dense_to_numpy, is_float, numpy_to_dense, op_name, owner_op, \
    parent_of, reads, shape_of
from .module import SYMBOL_ATTRS, drop_uncalled_private, erase_unused
from .patterns import Evaluator, index_value

ir, stablehlo, func_dialect = C.mlir()

NOT_COUNTED = ("its loop is not a counted one (a counter from a constant, stepped by a "
               "constant, while counter < a constant, and one counting 0, 1, ...): its "
               "layers are not known one by one")


class Loop:
    """A counted ``stablehlo.while``: ``length`` iterations, its counters (body argument →
    (start, step)), ``row`` (the counter that is the iteration number: start 0, step 1), the
    loop-invariant operands and those known now (argument → value)."""

    def __init__(self, length, counters, row, invariant, known):
        self.length, self.counters, self.row = length, counters, row
        self.invariant, self.known = invariant, known


def _step(value, arg, bound: dict, symbols: dict, depth: int = 0) -> int | None:
    """The constant ``c`` where ``value`` is ``arg + c`` — directly, or returned so by a
    private function the body calls with ``arg`` (``fori_loop``'s body returns ``i + 1``)."""
    op = owner_op(value)
    if op is None or depth > 8:
        return None
    if op_name(op) == "stablehlo.add":
        x, y = op.operands
        other = y if x == arg else x if y == arg else None
        return None if other is None else index_value(other, bound)
    if op_name(op) == "func.call":
        callee = symbols.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        if callee is None or not callee.regions[0].blocks:
            return None
        cb = callee.regions[0].blocks[0]
        k = next(i for i, r in enumerate(op.results) if r == value)
        inner = list(cb.operations)[-1].operands[k]
        for j, v in enumerate(op.operands):
            if v == arg:
                got = _step(inner, cb.arguments[j], bound, symbols, depth + 1)
                if got is not None:
                    return got
    return None


def loop_form(w, ev: Evaluator, symbols: dict) -> Loop | str | None:
    """``w`` as a counted loop over known stacks; why not (a str) where it reads known
    stacks but is not counted; None where it reads no known stack (whether its body folds
    is known from its first layer)."""
    body, cond = w.regions[1].blocks[0], w.regions[0].blocks[0]
    ret = list(body.operations)[-1]
    args = list(body.arguments)
    invariant = {k for k, a in enumerate(args) if ret.operands[k] == a}
    known = {}
    for k in sorted(invariant):
        if is_float(w.operands[k]) and (v := ev(w.operands[k])) is not None:
            known[k] = np.asarray(v)
    if not any(np.ndim(v) for v in known.values()):
        return None
    counters = {}
    for k, a in enumerate(args):
        if k in invariant or shape_of(a) != () or is_float(a):
            continue
        start = index_value(w.operands[k], ev.bound)
        step = None if start is None else _step(ret.operands[k], a, ev.bound, symbols)
        if step:
            counters[k] = (start, step)
    test = owner_op(list(cond.operations)[-1].operands[0])
    if test is None or op_name(test) != "stablehlo.compare" or \
            str(test.attributes["comparison_direction"]).split()[-1].rstrip(">") != "LT":
        return NOT_COUNTED
    lhs, bound = test.operands[0], index_value(test.operands[1], ev.bound)
    j = next((k for k, a in enumerate(cond.arguments) if a == lhs), None)
    if j not in counters or bound is None or counters[j][1] < 0:
        return NOT_COUNTED
    start, step = counters[j]
    length = max(0, -(-(bound - start) // step))
    row = next((k for k, (a, c) in counters.items() if (a, c) == (0, 1)), None)
    if row is None:
        return NOT_COUNTED
    if length < 1 or not any(np.ndim(v) and v.shape[0] == length for v in known.values()):
        return None
    return Loop(length, counters, row, invariant, known)


def _walk(block):
    for op in block.operations:
        yield op
        for region in op.regions:
            for b in region.blocks:
                yield from _walk(b)


def _inside(value, w) -> bool:
    """Whether ``value`` is defined in ``w``'s regions."""
    op = owner_op(value)
    op = op if op is not None else ir.BlockArgument(value).owner.owner
    while op is not None:
        if op == w:
            return True
        op = parent_of(op)
    return False


def _remap(op, mapping: dict) -> None:
    for i, v in enumerate(op.operands):
        got = mapping.get(v)
        if got is not None:
            op.operands[i] = got
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                _remap(inner, mapping)


def _clone(ops, mapping: dict, symbols: dict, pure: set | None = None, depth: int = 0) -> None:
    """Clone ``ops`` where you are, operands renamed by ``mapping`` (filled with the
    clones' results). A call of a private function that reads a value in ``pure``
    (computed from the loop's known operands, counters and constants only: the weights) is
    inlined, its body cloned, so that the fold sees the weights where they are read; other
    calls stay calls (a nonlinearity's ``@silu``)."""
    for op in ops:
        if op_name(op) == "func.call" and depth < 64:
            callee = symbols.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
            if callee is not None and callee.regions[0].blocks and \
                    "sym_visibility" in callee.attributes and \
                    ir.StringAttr(callee.attributes["sym_visibility"]).value == "private" and \
                    pure is not None and any(v in pure for v in op.operands):
                cb = callee.regions[0].blocks[0]
                inner = dict(zip(cb.arguments, [mapping.get(v, v) for v in op.operands]))
                pure.update(a for a, v in zip(cb.arguments, op.operands) if v in pure)
                body = list(cb.operations)
                _clone(body[:-1], inner, symbols, pure, depth + 1)
                for r, v in zip(op.results, body[-1].operands):
                    mapping[r] = inner.get(v, v)
                    if v in pure:
                        pure.add(r)
                continue
        new = op.clone()
        _remap(new, mapping)
        for r, n in zip(op.results, new.results):
            mapping[r] = n
        if pure is not None and not len(op.regions) and all(v in pure for v in op.operands):
            pure.update(op.results)


def _layer_module(w, loop: Loop, symbols: dict, ev: Evaluator):
    """The body of ``w`` as ``@main`` of a module of its own (private calls inlined, values
    the body reads from outside the loop as constants), returning the carried values; or
    None where the body reads an unknown value from outside."""
    body = w.regions[1].blocks[0]
    ret = list(body.operations)[-1]
    carried = [k for k in range(len(body.arguments)) if k not in loop.invariant]
    outside = {}
    for op in list(body.operations)[:-1]:
        for v in reads(op):
            if v not in outside and not _inside(v, w):
                outside[v] = None
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        fop = func_dialect.FuncOp("main", ([a.type for a in body.arguments],
                                           [ret.operands[k].type for k in carried]),
                                  visibility="public")
    entry = fop.add_entry_block()
    mapping = dict(zip(body.arguments, entry.arguments))
    with ir.InsertionPoint(entry):
        for v in outside:
            x = ev(v) if is_float(v) else index_value(v, ev.bound)
            if x is None:
                return None
            mapping[v] = stablehlo.ConstantOp(numpy_to_dense(np.asarray(x), ir.RankedTensorType(
                v.type).element_type) if is_float(v) else ir.DenseElementsAttr.get_splat(
                    ir.RankedTensorType(v.type), ir.IntegerAttr.get(
                        ir.RankedTensorType(v.type).element_type, int(x)))).result
        pure = {body.arguments[k] for k in (*loop.known, *loop.counters)} | set(outside)
        _clone(list(body.operations)[:-1], mapping, symbols, pure)
        func_dialect.ReturnOp([mapping.get(ret.operands[k], ret.operands[k]) for k in carried])
    _copy_callees(module, symbols)
    return module, fop


def _copy_callees(module, symbols: dict) -> None:
    """The private functions the layer module still refers to (from nested regions)."""
    have = {"main"}
    while True:
        want = set()
        for fop in module.body.operations:
            for op in _walk(fop.regions[0].blocks[0]):
                for key in SYMBOL_ATTRS:
                    if key in op.attributes:
                        a = op.attributes[key]
                        refs = list(ir.ArrayAttr(a)) if isinstance(a, ir.ArrayAttr) else [a]
                        want.update(ir.FlatSymbolRefAttr(r).value for r in refs)
        new = [n for n in want - have if n in symbols]
        if not new:
            return
        for n in new:
            symbols[n].clone(ip=ir.InsertionPoint(module.body))
            have.add(n)


def _callees_changed(module, symbols: dict) -> bool:
    return any(str(f) != str(symbols[n]) for f in module.body.operations
               if (n := ir.StringAttr(f.attributes["sym_name"]).value) != "main")


def _constants(fop) -> tuple[Any, list, list]:
    """A folded layer up to the values of its top-level constants: (key, values, ops)."""
    entry = fop.regions[0].blocks[0]
    values, ops, nested = [], [], []
    for op in entry.operations:
        if op_name(op) == "stablehlo.constant":
            v = dense_to_numpy(op.attributes["value"])
            values.append(v if v is not None else str(op.attributes["value"]))
            ops.append(op)
        else:
            nested += [str(o.attributes["value"]) for o in _walk_regions(op)
                       if op_name(o) == "stablehlo.constant"]
    key = (fop.operation.get_asm(large_elements_limit=0), tuple(nested))
    return key, values, ops


def _walk_regions(op):
    for region in op.regions:
        for b in region.blocks:
            yield from _walk(b)


def fold_stacks(module, symbols: dict, fold: Callable, bound: dict | None = None):
    """Fold every counted loop over known stacks in ``module`` per layer (``fold(module,
    bound)``: the pass, returning its report). Returns ``(records, left)``: the records of
    the stacks folded (one per site of a body, with the stack length) and, for loops whose
    layers do not fold alike, ``{while op: (reason, length)}`` for the pass to say."""
    ev = Evaluator(module, bound)
    records, left, callees = [], {}, set()
    for fname, fop in list(symbols.items()):
        if not fop.regions[0].blocks:
            continue
        for w in [o for o in _walk(fop.regions[0].blocks[0])
                  if op_name(o) == "stablehlo.while" and not _in_while(o)]:
            loop = loop_form(w, ev, symbols)
            if loop is None:
                continue
            if isinstance(loop, str):
                left[w.operation] = (Reason("weights-not-known", "the weights reach this "
                                            f"site through a stablehlo.while, and {loop}"),
                                     None)
                continue
            got = _fold_loop(w, loop, symbols, ev, fold)
            if isinstance(got, str):
                left[w.operation] = (layers_differ(got), loop.length)
            elif got is not None:
                ev.memo.clear()        # (keyed by values: the old loop's are gone)
                callees |= got[0]
                for rec in got[1]:
                    rec.scope = f"@{fname}"
                records += got[1]
    while callees:           # the private functions only the old loops called
        n = len(list(module.body.operations))
        drop_uncalled_private(module, only=callees)
        if len(list(module.body.operations)) == n:
            break
    for name in [n for n in symbols if n in callees]:
        if not any(ir.StringAttr(o.attributes["sym_name"]).value == name
                   for o in module.body.operations if op_name(o) == "func.func"):
            del symbols[name]
    return records, left


def stack_loops(module) -> list:
    """The loops :func:`fold_stacks` rebuilt (marked ``STACK``)."""
    return [o for fop in module.body.operations
            if op_name(fop) == "func.func" and fop.regions[0].blocks
            for o in _walk(fop.regions[0].blocks[0])
            if op_name(o) == "stablehlo.while" and marked(o, STACK)]


def _in_while(op) -> bool:
    p = parent_of(op)
    while p is not None and op_name(p) != "func.func":
        if op_name(p) == "stablehlo.while":
            return True
        p = parent_of(p)
    return False


def _fold_loop(w, loop: Loop, symbols: dict, ev: Evaluator, fold: Callable):
    """``(the private functions the old body called, the records)`` of ``w`` folded per
    layer and rebuilt; why its layers differ (a str); or None (nothing folds, or the body
    reads an unknown value from outside)."""
    stack, first, records = Restack(loop.length), None, []
    for layer in range(loop.length):
        built = _layer_module(w, loop, symbols, ev)
        if built is None:
            return None
        module, fop = built
        entry = fop.regions[0].blocks[0]
        # the counters as this layer's constants while it folds (a value computed from a
        # counter is not one from an argument: the scale read at the counter and the
        # activations share no lineage), the arguments again after
        counters = []
        with ir.InsertionPoint.at_block_begin(entry):
            for k, (a, st) in loop.counters.items():
                arg = entry.arguments[k]
                t = ir.RankedTensorType(arg.type)
                c = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                    t, ir.IntegerAttr.get(t.element_type, a + layer * st))).result
                arg.replace_all_uses_with(c)
                counters.append((c, arg))
        given = {entry.arguments[k]: v for k, v in loop.known.items()}
        recs = fold(module, given).sites
        for c, arg in counters:
            c.replace_all_uses_with(arg)
            c.owner.erase()
        if _callees_changed(module, symbols):
            return None        # a fold inside a function the body calls: not restacked
        erase_unused([o for o in entry.operations][:-1])   # (the slices no fold reads)
        if layer == 0 and not any(r.status == FOLDED for r in recs):
            return None
        records.append(recs)
        key, values, ops = _constants(fop)
        why = stack.add(key, values)
        if why is not None:
            return first_difference(records[0], recs, layer)
        if layer == 0:
            first = (module, fop, ops)
        else:
            del module, fop
    return _rebuild(w, loop, first, stack.result(), symbols), layer_records(records, loop.length)


def _callees(block, symbols: dict) -> set:
    """The functions ``block`` calls, directly or through others."""
    out, todo = set(), [block]
    while todo:
        for o in _walk(todo.pop()):
            if op_name(o) == "func.call":
                name = ir.FlatSymbolRefAttr(o.attributes["callee"]).value
                if name not in out and name in symbols:
                    out.add(name)
                    if symbols[name].regions[0].blocks:
                        todo.append(symbols[name].regions[0].blocks[0])
    return out


def _rebuild(w, loop: Loop, first, plan, symbols: dict) -> set:
    """Replace ``w`` with a loop running layer 0's folded body, its per-layer constants read
    from stacked operands of its own at the iteration number."""
    _, fop, cops = first
    entry = fop.regions[0].blocks[0]
    cond, body = w.regions[0].blocks[0], w.regions[1].blocks[0]
    n = len(entry.arguments)
    kept = [k for k in range(n) if k not in loop.invariant or
            next(iter(entry.arguments[k].uses), None) is not None or
            next(iter(cond.arguments[k].uses), None) is not None]
    stacked = {j: arr for j, arr in plan.stacked}
    etypes = {j: ir.RankedTensorType(cops[j].results[0].type).element_type for j in stacked}
    with ir.InsertionPoint(w):
        news = [stablehlo.ConstantOp(numpy_to_dense(arr, etypes[j])).result
                for j, arr in plan.stacked]
    operands = [w.operands[k] for k in kept] + news
    types = [v.type for v in operands]
    with ir.InsertionPoint(w):
        nw = make("stablehlo.while", types, operands, regions=2)
    cb = nw.regions[0].blocks.append(*types)
    bb = nw.regions[1].blocks.append(*types)
    cmap = {cond.arguments[k]: cb.arguments[i] for i, k in enumerate(kept)}
    with ir.InsertionPoint(cb):
        _clone(list(cond.operations), cmap, {})
    bmap = {entry.arguments[k]: bb.arguments[i] for i, k in enumerate(kept)}
    row = bb.arguments[kept.index(loop.row)]
    slot = {cops[j]: len(kept) + i for i, (j, _) in enumerate(plan.stacked)}
    ops = list(entry.operations)
    with ir.InsertionPoint(bb):
        zero = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
            ir.RankedTensorType(row.type), ir.IntegerAttr.get(
                ir.RankedTensorType(row.type).element_type, 0))).result
        for op in ops[:-1]:
            i = slot.get(op)
            if i is None:
                _clone([op], bmap, {})
                continue
            t = ir.RankedTensorType(op.results[0].type)
            s = make("stablehlo.dynamic_slice", [ir.RankedTensorType.get(
                [1] + list(t.shape), t.element_type)], [bb.arguments[i], row] +
                [zero] * len(t.shape), {"slice_sizes": ir.DenseI64ArrayAttr.get(
                    [1] + list(t.shape))}).result
            bmap[op.results[0]] = make("stablehlo.reshape", [t], [s]).result
        carried = iter(bmap.get(v, v) for v in ops[-1].operands)
        out = [bb.arguments[i] if k in loop.invariant else next(carried)
               for i, k in enumerate(kept)] + list(bb.arguments[len(kept):])
        make("stablehlo.return", [], out)
    mark(nw, STACK)
    old = [owner_op(w.operands[k]) for k in range(n) if k not in kept]
    callees = _callees(body, symbols)
    for i, k in enumerate(kept):
        w.results[k].replace_all_uses_with(nw.results[i])
    for k in range(n):
        if k not in kept:
            w.results[k].replace_all_uses_with(w.operands[k])
    w.erase()
    erase_unused([o for o in old if o is not None])
    return callees
