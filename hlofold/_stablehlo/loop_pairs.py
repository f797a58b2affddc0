"""Cross-layer equalization inside scanned layer stacks on the StableHLO path: the twin of
``fold_params(..., equalize=True)`` on a scan (:mod:`hlofold._core.layer_pairs`).

A scan over stacked weights is a counted ``stablehlo.while`` whose loop-invariant operands are
the stacks, each layer reading its row through ``dynamic_slice`` at the counter
(:func:`~hlofold._stablehlo.loops.loop_form`). Each layer's body is made a module of its own
(:func:`~hlofold._stablehlo.loops.layer_module`, the counters that layer's constants), the
rows it reads of the known stacks become constants there, and the body's pairs are equalized
as a function's are (:func:`~hlofold._stablehlo.equalize.equalized_pairs`: each layer its own
scales, from its own rows). The layers' constants are restacked (``_core.stacks.Restack``) and
the loop rebuilt to read them at the iteration number, as the scanned-stack fold does; one
record per pair, merged over the layers by the core (``layer_pairs.merged``).
"""
from __future__ import annotations

from .. import _compat as C
from .._core.equalize import EqualizedPair, NotEqualized, record
from .._core.layer_pairs import merged
from .._core.stacks import Restack
from .build import STACK, marked, unmark
from .equalize import equalized_pairs
from .ir import numpy_to_dense, op_name, owner_op, shape_of
from .loops import Loop, layer_counters, layer_module, loop_form, rebuild_loop
from .module import erase_unused, main_function
from .patterns import Evaluator
from .stacks import layer_constants

ir, stablehlo, _ = C.mlir()


def equalize_loops(module, names: dict) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Equalize the layers of every counted loop over known stacks at ``@main``'s top level,
    each layer with its own scales; the loops rebuilt. Returns the records and the
    refusals; the loops done are marked ``STACK`` until :func:`unmark_loops`."""
    symbols = {ir.StringAttr(op.attributes["sym_name"]).value: op
               for op in module.body.operations if op_name(op) == "func.func"}
    func = main_function(module)
    ev = Evaluator(module)
    recs, left = [], []
    for w in [o for o in func.regions[0].blocks[0].operations
              if op_name(o) == "stablehlo.while" and not marked(o, STACK)]:
        loop = loop_form(w, ev, symbols)
        if not isinstance(loop, Loop):
            continue
        got = _equalize_loop(w, loop, symbols, ev, names)
        if got is not None:
            ev.memo.clear()                 # (keyed by values: the old loop's are gone)
            recs += got[0]
            left += got[1]
    return recs, left


def unmark_loops(module) -> None:
    for o in main_function(module).regions[0].blocks[0].operations:
        if op_name(o) == "stablehlo.while" and marked(o, STACK):
            unmark(o, STACK)


_ROW_OPS = ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.reshape")


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


def _equalize_loop(w, loop: Loop, symbols: dict, ev: Evaluator, names: dict):
    """``(records, refusals)`` of ``w``'s layers equalized and the loop rebuilt; or None
    (no pair in its first layer, an unknown value read from outside the loop, or layers
    whose bodies differ: the loop is left as it was)."""
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
        ok, did, called, refused = equalized_pairs(fop, called_rows, loops=False)
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
                           "equalized"))
    return recs, [NotEqualized(n.kernel, n.location + f" (in a scanned stack of "
                               f"{loop.length} layers)", n.reason) for n in left]
