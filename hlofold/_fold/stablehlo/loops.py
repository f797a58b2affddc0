"""The loops of the StableHLO path, as the scanned-stack fold reads and writes them.

:func:`loop_form` reads a ``stablehlo.while`` as a counted loop (counters from constants by
constant steps, ``counter < bound``) over known stacks; :func:`layer_module` makes its body a
module of its own (``@main`` taking the body's arguments; private calls that read the weights
inlined, so that a fold sees them where they are read); :func:`rebuild_loop` puts a folded
body back as a new loop whose per-layer values are stacked operands read at the iteration
number; :func:`row_of` reads one row of a stack (``hoist.py`` builds on these for ``split=``).
"""
from __future__ import annotations

import contextlib

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._ir.stablehlo.build import STACK, int_constant, make, mark
from hlofold._ir.stablehlo.ir import (is_float, numpy_to_dense, op_name, owner_op, parent_of, reads,
                                      shape_of)
from hlofold._ir.stablehlo.module import SYMBOL_ATTRS, erase_unused, walk
from hlofold._ir.stablehlo.indices import index_value, step_of, trip_count
from .patterns import Evaluator

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


def loop_form(w, ev: Evaluator, symbols: dict, staged: bool = False) -> Loop | str | None:
    """``w`` as a counted loop over known stacks (``staged``: or stacks not known, folded in
    the graph and hoisted); why not (a str) where it reads known stacks but is not counted;
    None where it reads no such stack (whether its body folds is known from its first
    layer)."""
    body = w.regions[1].blocks[0]
    ret = list(body.operations)[-1]
    args = list(body.arguments)
    invariant = {k for k, a in enumerate(args) if ret.operands[k] == a}
    known = {}
    for k in sorted(invariant):
        if is_float(w.operands[k]) and (v := ev(w.operands[k])) is not None:
            known[k] = np.asarray(v)
    if not any(np.ndim(v) for v in known.values()) and not staged:
        return None
    counters = {}
    for k, a in enumerate(args):
        if k in invariant or shape_of(a) != () or is_float(a):
            continue
        start = index_value(w.operands[k], ev.bound)
        step = None if start is None else step_of(ret.operands[k], a, ev.bound)
        if step:
            counters[k] = (start, step)
    trips = trip_count(w, ev.bound)
    if trips is None or trips[1] not in counters:
        return NOT_COUNTED
    length = trips[0]
    row = next((k for k, (a, c) in counters.items() if (a, c) == (0, 1)), None)
    if row is None:
        return NOT_COUNTED
    # (an unrolled scan's loop reads ``unroll`` rows of a stack per iteration)
    stacks = [k for k in invariant if is_float(w.operands[k]) and length and
              len(shape_of(w.operands[k])) and shape_of(w.operands[k])[0] % length == 0]
    if length < 1 or not stacks or (not staged and not any(k in known for k in stacks)):
        return None
    return Loop(length, counters, row, invariant, known)


BRANCHING = ops.names(lambda o: o.branches)


def nested_constants(op, branches: bool = True):
    """``(constant, in branches only)`` for each constant in ``op``'s regions, in program
    order: whether every op around it (``op`` included) is a ``case``/``if`` — a value of the
    enclosing block may be read there, so a constant there can become a row read outside."""
    ok = branches and op_name(op) in BRANCHING
    for region in op.regions:
        for b in region.blocks:
            for o in b.operations:
                if op_name(o) == "stablehlo.constant":
                    yield o, ok
                elif len(o.regions):
                    yield from nested_constants(o, ok)


def inside(value, w) -> bool:
    """Whether ``value`` is defined in ``w``'s regions."""
    op = owner_op(value)
    op = op if op is not None else ir.BlockArgument(value).owner.owner
    while op is not None:
        if op == w:
            return True
        op = parent_of(op)
    return False


def remap(op, mapping: dict) -> None:
    for i, v in enumerate(op.operands):
        got = mapping.get(v)
        if got is not None:
            op.operands[i] = got
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                remap(inner, mapping)


def clone(ops, mapping: dict, symbols: dict, pure: set | None = None,
          depth: int = 0) -> list:
    """Clone ``ops`` where you are, operands renamed by ``mapping`` (filled with the
    clones' results); returns the clones. A call of a private function that reads a value in ``pure``
    (computed from the loop's known operands, counters and constants only: the weights) is
    inlined, its body cloned, so that the fold sees the weights where they are read; other
    calls stay calls (a nonlinearity's ``@silu``)."""
    made = []
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
                made += clone(body[:-1], inner, symbols, pure, depth + 1)
                for r, v in zip(op.results, body[-1].operands):
                    mapping[r] = inner.get(v, v)
                    if v in pure:
                        pure.add(r)
                continue
        new = op.clone()
        remap(new, mapping)
        made.append(new)
        for r, n in zip(op.results, new.results):
            mapping[r] = n
        if pure is not None and not len(op.regions) and all(v in pure for v in op.operands):
            pure.update(op.results)
    return made


def layer_module(w, loop: Loop, symbols: dict, ev: Evaluator):
    """The body of ``w`` as ``@main`` of a module of its own (private calls inlined, values
    the body reads from outside the loop as constants), returning the carried values; or
    None where the body reads an unknown value from outside."""
    body = w.regions[1].blocks[0]
    ret = list(body.operations)[-1]
    carried = [k for k in range(len(body.arguments)) if k not in loop.invariant]
    outside = {}
    for op in list(body.operations)[:-1]:
        for v in reads(op):
            if v not in outside and not inside(v, w):
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
            mapping[v] = int_constant(v.type, x) if not is_float(v) else \
                stablehlo.ConstantOp(numpy_to_dense(np.asarray(x), ir.RankedTensorType(
                    v.type).element_type)).result
        pure = {body.arguments[k] for k in (*loop.invariant, *loop.counters)} | set(outside)
        clone(list(body.operations)[:-1], mapping, symbols, pure)
        func_dialect.ReturnOp([mapping.get(ret.operands[k], ret.operands[k]) for k in carried])
    copy_callees(module, symbols)
    copy_meshes(module, w)
    return module, fop


def copy_meshes(module, op) -> None:
    """The ``sdy.mesh`` symbols of the module holding ``op``, put in ``module`` (the layer
    module of a loop whose body names them: sharding constraints of a scanned stack)."""
    top = op
    while (p := parent_of(top)) is not None:
        top = p
    meshes = [m for m in top.regions[0].blocks[0].operations if op_name(m) == "sdy.mesh"]
    first = next(iter(module.body.operations), None)
    for m in meshes:
        m.clone(ip=ir.InsertionPoint(first) if first is not None else
                ir.InsertionPoint(module.body))


@contextlib.contextmanager
def layer_counters(fop, loop: Loop, layer: int):
    """Within: the loop's counters are layer ``layer``'s constants in its layer module
    ``fop`` (a value computed from a counter is not one from an argument: the scale read at
    the counter and the activations share no lineage); the arguments again after."""
    entry = fop.regions[0].blocks[0]
    counters = []
    with ir.InsertionPoint.at_block_begin(entry):
        for k, (a, st) in loop.counters.items():
            arg = entry.arguments[k]
            c = int_constant(arg.type, a + layer * st)
            arg.replace_all_uses_with(c)
            counters.append((c, arg))
    try:
        yield
    finally:
        for c, arg in counters:
            c.replace_all_uses_with(arg)
            c.owner.erase()


def copy_callees(module, symbols: dict) -> None:
    """The private functions the layer module still refers to (from nested regions)."""
    have = {"main"}
    while True:
        want = set()
        for fop in module.body.operations:
            for op in walk(fop.regions[0].blocks[0]):
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


def callees_changed(module, symbols: dict) -> bool:
    return any(str(f) != str(symbols[n]) for f in module.body.operations
               if op_name(f) == "func.func" and
               (n := ir.StringAttr(f.attributes["sym_name"]).value) != "main")


def callees(block, symbols: dict) -> set:
    """The functions ``block`` calls, directly or through others."""
    out, todo = set(), [block]
    while todo:
        for o in walk(todo.pop()):
            if op_name(o) == "func.call":
                name = ir.FlatSymbolRefAttr(o.attributes["callee"]).value
                if name not in out and name in symbols:
                    out.add(name)
                    if symbols[name].regions[0].blocks:
                        todo.append(symbols[name].regions[0].blocks[0])
    return out


def rebuild_loop(w, loop: Loop, first, plan, symbols: dict, extra=()) -> set:
    """Replace ``w`` with a loop running layer 0's folded body, its per-layer constants read
    from stacked operands of its own at the iteration number; ``extra``: the outer values
    of the body's arguments after the loop's own (:func:`hoist_prepared`'s stacks). Returns
    the private functions the old body called."""
    _, fop, cops = first
    entry = fop.regions[0].blocks[0]
    cond, body = w.regions[0].blocks[0], w.regions[1].blocks[0]
    n = len(w.operands)
    kept = [k for k in range(n) if k not in loop.invariant or
            next(iter(entry.arguments[k].uses), None) is not None or
            next(iter(cond.arguments[k].uses), None) is not None]
    stacked = {j: arr for j, arr in plan.stacked}
    etypes = {j: ir.RankedTensorType(cops[j].results[0].type).element_type for j in stacked}
    with ir.InsertionPoint(w):
        news = [stablehlo.ConstantOp(numpy_to_dense(arr, etypes[j])).result
                for j, arr in plan.stacked]
    operands = [w.operands[k] for k in kept] + list(extra) + news
    types = [v.type for v in operands]
    with ir.InsertionPoint(w):
        nw = make("stablehlo.while", types, operands, regions=2)
    cb = nw.regions[0].blocks.append(*types)
    bb = nw.regions[1].blocks.append(*types)
    cmap = {cond.arguments[k]: cb.arguments[i] for i, k in enumerate(kept)}
    with ir.InsertionPoint(cb):
        clone(list(cond.operations), cmap, {})
    bmap = {entry.arguments[k]: bb.arguments[i] for i, k in enumerate(kept)}
    bmap.update({entry.arguments[n + i]: bb.arguments[len(kept) + i]
                 for i in range(len(extra))})
    row = bb.arguments[kept.index(loop.row)]
    slot = {cops[j]: len(kept) + len(extra) + i for i, (j, _) in enumerate(plan.stacked)}
    ops = list(entry.operations)
    with ir.InsertionPoint(bb):
        zero = int_constant(row.type, 0)
        for op in ops[:-1]:
            i = slot.get(op)
            if i is not None:
                bmap[op.results[0]] = row_of(bb.arguments[i], row, zero)
                continue
            # constants in its branches read per layer: rows read before it, used inside
            rows = {k: row_of(bb.arguments[slot[c]], row, zero)
                    for k, (c, _) in enumerate(nested_constants(op)) if c in slot}
            (new,) = clone([op], bmap, {})
            for k, (c, _) in list(enumerate(nested_constants(new))) if rows else ():
                if k in rows:
                    c.results[0].replace_all_uses_with(rows[k])
                    c.erase()
        carried = iter(bmap.get(v, v) for v in ops[-1].operands)
        out = [bb.arguments[i] if k in loop.invariant else next(carried)
               for i, k in enumerate(kept)] + list(bb.arguments[len(kept):])
        make("stablehlo.return", [], out)
    if next(iter(zero.uses), None) is None:       # (no stacked constant read a row)
        zero.owner.erase()
    mark(nw, STACK)
    old = [owner_op(w.operands[k]) for k in range(n) if k not in kept]
    called = callees(body, symbols)
    for i, k in enumerate(kept):
        w.results[k].replace_all_uses_with(nw.results[i])
    for k in range(n):
        if k not in kept:
            w.results[k].replace_all_uses_with(w.operands[k])
    w.erase()
    erase_unused([o for o in old if o is not None])
    return called


def row_of(stack, row, zero):
    """``stack[row]`` (insert where you are): a ``dynamic_slice`` of one row, reshaped."""
    t = ir.RankedTensorType(stack.type)
    one = ir.RankedTensorType.get([1] + list(t.shape[1:]), t.element_type)
    s = make("stablehlo.dynamic_slice", [one], [stack, row] + [zero] * (len(t.shape) - 1),
             {"slice_sizes": ir.DenseI64ArrayAttr.get([1] + list(t.shape[1:]))}).result
    return make("stablehlo.reshape", [ir.RankedTensorType.get(list(t.shape[1:]),
                                                              t.element_type)], [s]).result
