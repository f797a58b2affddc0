"""Split a StableHLO module whose weights are arguments into *prepare* and *apply*.

For a deployment that loads its weights at run time and has no hlofold there: the module is
folded in the graph (as ``in_graph=True``, but without the per-site run-time guard), then
every top-level op of ``@main`` is put on one side by what it depends on:

* ops that read the per-call arguments (or values computed from them) go to **apply**;
* ops that read only weights (the rescale ``K ⊙ s``, the bias ``t``) go to **prepare**,
  which runs once per set of weights;
* ops that read neither (constants) go wherever they are used.

The guard's check moves to prepare: its last result is a ``tensor<i1>``, true when every
folded kernel and bias is finite. When it is false (a BatchNorm whose σ² = 0 with ε = 0, an
inf γ) the apply module is not valid for these weights: run the original module.

The values that cross from prepare to apply are prepare's results and apply's trailing
arguments. A crossing value made by ``broadcast_in_dim`` (a bias broadcast to the
activation's shape) is not passed: the broadcast moves to apply and its small operand
crosses instead, so apply never reads more than the original module did.
"""
from __future__ import annotations

from typing import Any, Sequence

from hlofold import _compat as C
from hlofold._base.report import FoldReport
from hlofold._ir.stablehlo.build import PREPARED, all_finite, marked, unmark
from hlofold._ir.stablehlo.ir import StableHLOError, location, op_name, reads
from hlofold._ir.stablehlo.module import drop_uncalled_private, main_function, parse_module
from .calls import inline_layer_calls
from .fold import fold_module
from hlofold._ir.stablehlo.shardings import (argument_shardings, from_arguments,
                                             set_argument_shardings, set_result_shardings)
from hlofold._ir.stablehlo.weights import argument_index, set_arguments

ir, stablehlo, _ = C.mlir()

CALL, WEIGHT, CONST = "call", "weight", "const"
_MOVABLE = ("stablehlo.broadcast_in_dim",)       # cheap enough to redo per call


def split_module(text_or_bytes, per_call: Sequence[Any],
                 merge: bool = True) -> tuple[Any, Any, FoldReport]:
    """``(prepare module, apply module, report)``. ``per_call``: the ``@main`` arguments
    that change on every call (``0``, ``"arg0"``); all others are weights. ``prepare``
    takes the weights (in their order) and returns what ``apply`` takes after the per-call
    arguments, then ``ok`` (``tensor<i1>``: apply is valid for these weights)."""
    if isinstance(per_call, (str, int)):
        per_call = [per_call]
    calls = sorted({argument_index(a) for a in per_call})
    module = parse_module(text_or_bytes)
    with module.context, ir.Location.unknown():
        n = len(main_function(module).regions[0].blocks[0].arguments)
        if not calls or calls[-1] >= n:
            raise StableHLOError(f"per-call arguments {calls}: @main takes {n} arguments "
                                 f"(arg0 .. arg{n - 1}); name at least one of them")
        # a layer in a private function (a jit helper, called once or per layer): its
        # folded weights made where @main calls it, where prepare can take them (in the
        # callee they were computed from its arguments on every call of apply)
        if inline_layer_calls(module):
            drop_uncalled_private(module)
        report = fold_module(module, in_graph=True, guard=False, merge=merge)
        kinds, crossing, moved = _classify(main_function(module), set(calls))
        _check_prepared(main_function(module), kinds, calls)
        text = str(module)
    prepare, apply = parse_module(text), parse_module(text)
    with prepare.context, ir.Location.unknown():
        _make_prepare(main_function(prepare), kinds, crossing, moved, calls)
        drop_uncalled_private(prepare)
        if not prepare.operation.verify():
            raise AssertionError("hlofold produced an invalid prepare module")  # pragma: no cover
    with apply.context, ir.Location.unknown():
        _make_apply(main_function(apply), kinds, crossing, moved, calls)
        drop_uncalled_private(apply)
        if not apply.operation.verify():
            raise AssertionError("hlofold produced an invalid apply module")  # pragma: no cover
    return prepare, apply, report


def _check_prepared(main, kinds, calls) -> None:
    """Every folded kernel and bias (marked ``PREPARED``) must be computed from weights
    alone: one computed from a per-call argument cannot be prepared once (the arguments
    named per call include a BatchNorm's statistics or a kernel, or what scales a site is
    computed from the activations)."""
    ops = list(main.regions[0].blocks[0].operations)
    bad = [op for op, k in zip(ops, kinds) if k == CALL and marked(op, PREPARED)]
    if bad:
        names = ", ".join(f"arg{i}" for i in sorted(calls))
        file, line, name = location(bad[0])
        where = f"{file}:{line}" if file and line else name or "an op of @main"
        raise StableHLOError(
            f"split=: the folded weights of {len(bad)} site(s) (the first at "
            f"{where}) would be computed from the per-call arguments ({names}) "
            f"on every call, so they cannot be prepared once: name as per-call only the "
            f"arguments that change on every call (the activations), or fold with "
            f"in_graph=True")


def _classify(main, calls: set[int]):
    """Per top-level op (by position): CALL / WEIGHT / CONST; the crossing values as
    ``(op position or -1 for an argument, result or argument number)``; the positions of
    WEIGHT ops moved to apply."""
    block = main.regions[0].blocks[0]
    kind_of: dict[Any, str] = {}
    for i, a in enumerate(block.arguments):
        kind_of[a] = CALL if i in calls else WEIGHT
    where: dict[Any, tuple[int, int]] = {a: (-1, i) for i, a in enumerate(block.arguments)}
    ops = list(block.operations)
    kinds = []
    for pos, op in enumerate(ops):
        deps = {kind_of.get(v) for v in reads(op)} - {None}
        k = CALL if CALL in deps else WEIGHT if WEIGHT in deps else CONST
        kinds.append(k)
        for j, r in enumerate(op.results):
            kind_of[r] = k
            where[r] = (pos, j)
    moved: set[int] = set()
    while True:      # weight values read on the apply side; broadcasts move to apply
        crossing = {}
        for pos, op in enumerate(ops):
            if kinds[pos] == CALL or pos in moved or op_name(op) == "func.return":
                for v in reads(op):
                    if kind_of.get(v) == WEIGHT:
                        crossing[where[v]] = v
        grow = {p for (p, _) in crossing if p >= 0 and op_name(ops[p]) in _MOVABLE} - moved
        if not grow:
            break
        moved |= grow
    crossing = {k: v for k, v in crossing.items() if k[0] not in moved}
    return kinds, sorted(crossing), moved


def _value(block, ops, key):
    pos, j = key
    return block.arguments[j] if pos < 0 else ops[pos].results[j]


def _make_prepare(main, kinds, crossing, moved, calls) -> None:
    block = main.regions[0].blocks[0]
    ops = list(block.operations)
    outs = [_value(block, ops, k) for k in crossing]
    shardings = argument_shardings(main)
    out_shardings = [from_arguments(v, block, shardings) for v in outs] + [{}]
    ret = ops[-1]
    with ir.InsertionPoint(ret):
        ok = None
        for op in ops:
            if marked(op, PREPARED):
                unmark(op, PREPARED)
                fin = all_finite(op.results[0])
                ok = fin if ok is None else stablehlo.AndOp(ok, fin).result
        if ok is None:
            scalar = ir.RankedTensorType.get([], ir.IntegerType.get_signless(1))
            ok = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                scalar, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), 1))).result
        outs.append(ok)
        ir.Operation.create("func.return", operands=outs)
    ret.erase()
    for pos in reversed(range(len(ops) - 1)):
        op = ops[pos]
        if kinds[pos] == CALL or (all(len(list(r.uses)) == 0 for r in op.results)
                                  and op_name(op) != "stablehlo.custom_call"):
            op.erase()
    weights = [i for i in range(len(block.arguments)) if i not in calls]
    set_arguments(main, weights)
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [a.type for a in block.arguments], [v.type for v in outs]))
    set_result_shardings(main, out_shardings)     # the prepared weights: as their origin


def _make_apply(main, kinds, crossing, moved, calls) -> None:
    block = main.regions[0].blocks[0]
    ops = list(block.operations)
    n = len(block.arguments)
    shardings = argument_shardings(main)
    new_shardings = [from_arguments(_value(block, ops, k), block, shardings) for k in crossing]
    for k in crossing:
        v = _value(block, ops, k)
        arg = block.add_argument(v.type, ir.Location.unknown())
        v.replace_all_uses_with(arg)
    for pos in reversed(range(len(ops) - 1)):
        op = ops[pos]
        if pos in moved or kinds[pos] == CALL:
            continue
        if kinds[pos] == WEIGHT or all(len(list(r.uses)) == 0 for r in op.results):
            op.erase()
    set_arguments(main, list(range(n)), appended=True)
    set_arguments(main, calls + list(range(n, len(block.arguments))))
    set_argument_shardings(main, {len(calls) + j: s for j, s in enumerate(new_shardings)})
