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
(``_fold.core.stacks.Restack``): the new loop takes the folded kernels and biases as stacked
operands of its own, read at the iteration number, and its body runs conv + bias; the old
stacks it no longer reads are dropped. Layers that do not fold alike leave the loop as it was,
and the pass gives its sites that reason.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from hlofold import _compat as C
from hlofold._base.reasons import Reason
from hlofold._base.report import FOLDED
from hlofold._fold.core.stacks import Restack, first_difference, layer_records, layers_differ
from hlofold._ir.stablehlo import blobs
from hlofold._ir.stablehlo.build import STACK, marked
from hlofold._ir.stablehlo.ir import constant_attr, dense_to_numpy, op_name, parent_of
from .hoist import hoist_prepared
from hlofold._ir.stablehlo.module import walk
from .loops import (Loop, callees_changed, layer_counters, layer_module, loop_form,
                    nested_constants, rebuild_loop)
from hlofold._ir.stablehlo.module import drop_uncalled_private, erase_unused
from .patterns import Evaluator

ir, stablehlo, func_dialect = C.mlir()


def layer_constants(fop) -> tuple[Any, list, list]:
    """A folded layer up to the values of its constants: (key, values, ops). The values are
    those of its top-level constants and of those inside ``case``/``if`` branches (rows of a
    stack read outside them); constants elsewhere (a nested loop's, a reduction's) are part
    of the key: where they differ between layers, the layers do not fold alike."""
    entry = fop.regions[0].blocks[0]
    values, ops, nested = [], [], []

    def take(op):
        attr = constant_attr(op)
        v = None if attr is None else dense_to_numpy(attr, copy=False)
        values.append(v if v is not None else str(op))
        ops.append(op)
    for op in entry.operations:
        if op_name(op) == "stablehlo.constant":
            take(op)
        elif len(op.regions):
            for c, branches in nested_constants(op):
                if branches:
                    take(c)
                else:
                    nested.append(_constant_key(c))
    # (a large constant made by the fold is a resource named per layer: its name elided)
    key = (_RESOURCE_NAME.sub("dense_resource<>", fop.operation.get_asm(
        large_elements_limit=0)), tuple(nested))
    return key, values, ops


_RESOURCE_NAME = re.compile(r"dense_resource<[^>]*>")


def _constant_key(op):
    attr = constant_attr(op)
    held = None if attr is None else blobs.value(attr)
    return str(op if attr is None else attr) if held is None else (
        held.shape, held.dtype.str, held.tobytes())


def fold_stacks(module, symbols: dict, fold: Callable, bound: dict | None = None,
                staged: bool = False):
    """Fold every counted loop over known stacks in ``module`` per layer (``fold(module,
    bound)``: the pass, returning its report). Returns ``(records, left)``: the records of
    the stacks folded (one per site of a body, with the stack length) and, for loops whose
    layers do not fold alike, ``{while op: (reason, length)}`` for the pass to say.
    ``staged`` (``split=``: in the graph, unguarded): loops over stacks not known fold too,
    what the body computes from the weights hoisted into a loop of its own
    (:func:`~hlofold._fold.stablehlo.loops.hoist_prepared`)."""
    ev = Evaluator(module, bound)
    records, left, dropped = [], {}, set()
    for fname, fop in list(symbols.items()):
        if not fop.regions[0].blocks:
            continue
        for w in [o for o in walk(fop.regions[0].blocks[0])
                  if op_name(o) == "stablehlo.while" and not _in_while(o)]:
            loop = loop_form(w, ev, symbols, staged)
            if loop is None:
                continue
            if isinstance(loop, str):
                left[w.operation] = (Reason("weights-not-known", "the weights reach this "
                                            f"site through a stablehlo.while, and {loop}"),
                                     None)
                continue
            got = _fold_loop(w, loop, symbols, ev, fold, staged)
            if isinstance(got, str):
                left[w.operation] = (layers_differ(got), loop.length)
            elif got is not None:
                ev.memo.clear()        # (keyed by values: the old loop's are gone)
                dropped |= got[0]
                for rec in got[1]:
                    rec.scope = f"@{fname}"
                records += got[1]
    while dropped:           # the private functions only the old loops called
        n = len(list(module.body.operations))
        drop_uncalled_private(module, only=dropped)
        if len(list(module.body.operations)) == n:
            break
    return records, left


def stack_loops(module) -> list:
    """The loops :func:`fold_stacks` rebuilt (marked ``STACK``)."""
    return [o for fop in module.body.operations
            if op_name(fop) == "func.func" and fop.regions[0].blocks
            for o in walk(fop.regions[0].blocks[0])
            if op_name(o) == "stablehlo.while" and marked(o, STACK)]


def _in_while(op) -> bool:
    p = parent_of(op)
    while p is not None and op_name(p) != "func.func":
        if op_name(p) == "stablehlo.while":
            return True
        p = parent_of(p)
    return False


def _fold_loop(w, loop: Loop, symbols: dict, ev: Evaluator, fold: Callable, staged: bool):
    """``(the private functions the old body called, the records)`` of ``w`` folded per
    layer and rebuilt; why its layers differ (a str); or None (nothing folds, or the body
    reads an unknown value from outside)."""
    stack, first, records = Restack(loop.length), None, []
    # with nothing known, every layer folds alike (in the graph): layer 0 is all of them
    for layer in range(loop.length if loop.known else 1):
        built = layer_module(w, loop, symbols, ev)
        if built is None:
            return None
        module, fop = built
        entry = fop.regions[0].blocks[0]
        given = {entry.arguments[k]: v for k, v in loop.known.items()}
        with layer_counters(fop, loop, layer):     # (the counters this layer's constants)
            recs = fold(module, given).sites
        if callees_changed(module, symbols):
            return None        # a fold inside a function the body calls: not restacked
        erase_unused([o for o in entry.operations][:-1])   # (the slices no fold reads)
        if layer == 0 and not any(r.status == FOLDED for r in recs):
            return None
        records.append(recs)
        key, values, ops = layer_constants(fop)
        why = stack.add(key, values)
        if why is not None:
            return first_difference(records[0], recs, layer)
        if layer == 0:
            first = (module, fop, ops)
        else:
            del module, fop
    extra = hoist_prepared(w, loop, first[1]) if staged else []
    return (rebuild_loop(w, loop, first, stack.result(), symbols, extra),
            layer_records(records, loop.length))


