"""Cross-layer equalization and smoothing inside scanned layer stacks on the StableHLO path:
the twin of ``fold_params(..., equalize=True / smooth=)`` on a scan
(:mod:`hlofold._quant.core.layer_pairs`).

A scan over stacked weights is a counted ``stablehlo.while`` whose loop-invariant operands are
the stacks, each layer reading its row through ``dynamic_slice`` at the counter
(:func:`~hlofold._fold.stablehlo.loops.loop_form`). Each layer's body is made a module of its own
(:func:`~hlofold._fold.stablehlo.loops.layer_module`, the counters that layer's constants), the
rows it reads of the known stacks become constants there, and the body's pairs are equalized
or smoothed as a function's are (:mod:`hlofold._quant.stablehlo.equalize`: each layer its own
scales, from its own rows and, to smooth, its own activations — the calibration inputs run
up to the loop, then through each layer's module in turn, :class:`_LayerSmoothing`). The
layers' constants are restacked (``_fold.core.stacks.Restack``) and the loop rebuilt to read them
at the iteration number, as the scanned-stack fold does; one record per pair, merged over
the layers by the core (``layer_pairs.merged``).
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._ir.stablehlo import ops
from hlofold._quant.core.equalize import EqualizedPair, NotEqualized, record
from hlofold._quant.core.smooth import Observed
from hlofold._quant.core.layer_pairs import merged
from hlofold._fold.core.stacks import Restack
from hlofold._ir.stablehlo.build import STACK, marked, unmark
from .equalize import apply_smoothing, equalized_pairs, smoothing_sites, watched_runs, watching_copy
from hlofold._ir.stablehlo.ir import element_dtype, numpy_to_dense, op_name, owner_op, shape_of
from hlofold._fold.stablehlo.loops import (Loop, layer_counters, layer_module, loop_form,
                                           rebuild_loop)
from hlofold._ir.stablehlo.module import erase_unused, functions, main_function
from hlofold._fold.stablehlo.patterns import Evaluator
from hlofold._fold.stablehlo.stacks import layer_constants
from hlofold._ir.stablehlo.weights import set_arguments

ir, stablehlo, _ = C.mlir()


def _counted_loops(module):
    """``(symbols, evaluator, [(loop op, Loop)])``: the counted loops over known stacks at
    ``@main``'s top level not rewritten yet (what both drivers below rewrite)."""
    symbols = functions(module)
    ev = Evaluator(module)
    loops = []
    for w in [o for o in main_function(module).regions[0].blocks[0].operations
              if op_name(o) == "stablehlo.while" and not marked(o, STACK)]:
        loop = loop_form(w, ev, symbols)
        if isinstance(loop, Loop):
            loops.append((w, loop))
    return symbols, ev, loops


def _rewrite_loops(loops, symbols: dict, ev: Evaluator, names: dict, kind: str, rewrite_of
                   ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Each loop's layers rewritten by ``rewrite_of(its index)`` (:func:`_per_layer`)."""
    recs, left = [], []
    for j, (w, loop) in enumerate(loops):
        got = _per_layer(w, loop, symbols, ev, names, kind, rewrite_of(j))
        if got is not None:
            ev.memo.clear()                 # (keyed by values: the old loop's are gone)
            recs += got[0]
            left += got[1]
    return recs, left


def equalize_loops(module, names: dict) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Equalize the layers of every counted loop over known stacks at ``@main``'s top level,
    each layer with its own scales; the loops rebuilt. Returns the records and the
    refusals; the loops done are marked ``STACK`` until :func:`unmark_loops`."""
    symbols, ev, loops = _counted_loops(module)
    return _rewrite_loops(loops, symbols, ev, names, "equalized", lambda _: (
        lambda layer, module, fop, rows: equalized_pairs(fop, rows, loops=False)))


def unmark_loops(module) -> None:
    for o in main_function(module).regions[0].blocks[0].operations:
        if op_name(o) == "stablehlo.while" and marked(o, STACK):
            unmark(o, STACK)


_ROW_OPS = ops.names(lambda o: o.selects or o.shape == "reshape")   # a stack's row read


def _rows_as_constants(fop, ev: Evaluator, stacks: dict, names: dict) -> dict:
    """Each row the body reads of a known stack (``dynamic_slice`` at a counter now
    constant; an unrolled loop's block of rows, sliced; reshaped) replaced by a constant of
    its value; ``{constant op: name}``."""
    entry = fop.regions[0].blocks[0]
    called, source = {}, dict(stacks)        # value -> the stack it is rows of
    for op in list(entry.operations):
        if op_name(op) not in _ROW_OPS or op.operands[0] not in source:
            continue
        v = op.results[0]
        x = ev(v)
        if x is None:
            continue
        with ir.InsertionPoint(op):
            c = stablehlo.ConstantOp(numpy_to_dense(x, ir.RankedTensorType(v.type)
                                                    .element_type))
        v.replace_all_uses_with(c.result)
        source[c.result] = source[op.operands[0]]
        name = names.get(owner_op(source[c.result]))
        if name:
            called[c.operation] = f"the rows of {name}"
    erase_unused([o for o in entry.operations][:-1])
    return called


def _one_row(w, loop: Loop) -> bool:
    """Whether each iteration reads one row of the stacks (not an unrolled scan's block)."""
    return all(shape_of(w.operands[k])[0] == loop.length for k in loop.known)


def _per_layer(w, loop: Loop, symbols: dict, ev: Evaluator, names: dict, kind: str, rewrite):
    """``(records, refusals)`` of ``w``'s layers rewritten one by one and the loop rebuilt;
    or None (no pair in its first layer, an unknown value read from outside the loop, or
    layers whose bodies differ: the loop is left as it was). ``rewrite(layer, module, fop,
    what its rows are called)`` rewrites one layer's module: ``(pairs, what was done to
    each, what the weights are called, what was left)``."""
    stack, first, done = Restack(loop.length), None, []
    suffix = (f" (in a scanned stack: each of its {loop.length} layers its own scales)"
              if _one_row(w, loop) else f" (in a scanned stack: each of its {loop.length} "
              f"iterations, several layers each, its own scales)")
    for layer in range(loop.length):
        built = layer_module(w, loop, symbols, ev)
        if built is None:
            return None
        module, fop = built
        entry = fop.regions[0].blocks[0]
        given = {entry.arguments[k]: v for k, v in loop.known.items()}
        stacks = {entry.arguments[k]: w.operands[k] for k in loop.known}
        with layer_counters(fop, loop, layer):     # (the rows read at them: constants)
            called_rows = _rows_as_constants(fop, Evaluator(module, given), stacks, names)
        ok, did, called, refused = rewrite(layer, module, fop, called_rows)
        if layer == 0:
            if not ok:
                return None
            first_pairs, first_called, left = ok, called, refused
        elif len(ok) != len(first_pairs):
            return None                       # (the layers pair differently)
        done.append(did)
        key, values, ops = layer_constants(fop)
        if stack.add(key, values) is not None:
            return None
        if layer == 0:
            first = (module, fop, ops)
        else:
            del module, fop
    rebuild_loop(w, loop, first, stack.result(), symbols)
    recs = []
    for j, f in enumerate(first_pairs):
        d = merged([layer_done[j] for layer_done in done])
        recs.append(record(d, first_called[f.pair.first],
                           [first_called[s.key] for s in f.pair.seconds],
                           [first_called[b] for b, _ in f.pair.biases], f.location + suffix,
                           kind))
    return recs, [NotEqualized(n.kernel, n.location + f" (in a scanned stack of "
                               f"{loop.length} layers)", n.reason) for n in left]


# ------------------------------------------------------------------------------ smoothing

def smooth_loops(module, names: dict, calibration: list, alpha: float, hoist
                 ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Smooth the layers of every counted loop over known stacks at ``@main``'s top level,
    each layer with its own scales from its own activations: the calibration inputs are run
    up to the loops (their operands returned), then each layer's module from what the one
    before it returned (the values its pairs' second layers read returned too). Marks the
    loops done as :func:`equalize_loops` does."""
    symbols, ev, loops = _counted_loops(module)
    if not loops:
        return [], []
    ks = [[k for k in range(len(w.operands)) if k not in loop.known and k not in loop.counters]
          for w, loop in loops]
    watch = [w.operands[k] for (w, _), kk in zip(loops, ks) for k in kk]
    runs = list(watched_runs(module, main_function(module), watch, calibration,
                             hoist))          # (the loops' operands, before a change)
    starts = np.cumsum([0] + [len(kk) for kk in ks])
    return _rewrite_loops(loops, symbols, ev, names, "smoothed", lambda j: _LayerSmoothing(
        loops[j][1], [dict(zip(ks[j], got[starts[j]:starts[j + 1]])) for got in runs],
        alpha, hoist))


class _LayerSmoothing:
    """One loop's layers smoothed in turn: each layer's module run on the calibration
    inputs' states (the loop's operands as that layer receives them), its pairs smoothed
    from what their second layers read; the states advanced to what it returns. The modules
    run differ in their hoisted rows only, and compile once."""

    def __init__(self, loop: Loop, states: list, alpha: float, hoist):
        self.loop, self.states, self.alpha, self.hoist = loop, states, alpha, hoist
        self.compiled: dict = {}

    def __call__(self, layer: int, module, fop, called_rows):
        s = smoothing_sites(fop, called_rows, loops=False)
        seen = self._run(layer, module, fop, s.every)   # (every layer: the states advance)
        done = apply_smoothing(s, seen, self.alpha) if s.every else []
        return s.every, done, s.called, s.left

    def _run(self, layer: int, module, fop, found: list) -> list[Observed]:
        """Run layer ``layer``'s module on each state: what the second layers of ``found``
        read, per channel; the states advanced."""
        copy, cfunc = watching_copy(module, fop, [f.end for f in found])
        block = cfunc.regions[0].blocks[0]
        kept = [k for k, a in enumerate(block.arguments) if next(iter(a.uses), None)]
        types = {k: block.arguments[k].type for k in kept}
        set_arguments(cfunc, kept)
        prepared = self.hoist(cfunc, copy=False)
        text = str(copy)
        run = self.compiled.get(text) or self.compiled.setdefault(text, module_callable(text))
        loop = self.loop
        carried = [k for k in range(len(fop.regions[0].blocks[0].arguments))
                   if k not in loop.invariant]
        seen = [Observed.for_alpha(self.alpha) for _ in found]
        for state in self.states:
            args = []
            for k in kept:
                if k in loop.counters:
                    start, step = loop.counters[k]
                    args.append(np.asarray(start + layer * step, element_dtype(
                        ir.RankedTensorType(types[k]).element_type)))
                else:
                    args.append(loop.known[k] if k in loop.known else state[k])
            out = run(*args, *prepared)
            for k, x in zip(carried, out[:len(carried)]):
                if k not in loop.counters:
                    state[k] = x
            for f, x, o in zip(found, out[len(carried):], seen):
                o.add(np.asarray(x), f.end_axis)
        return seen
