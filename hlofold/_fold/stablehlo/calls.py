"""Private functions called once per layer, each call with that layer's weights.

A ``@jax.jit`` block called per layer lowers to one private function and a ``func.call`` of
it per layer, the layer's weights (constants of the caller, or bound by ``params=``) as
operands. Inside the function those are block arguments, known at no single call: so a
function that holds a convolution or dot and is called more than once with a known float
operand is inlined at each of those calls (:func:`inline_weighted_calls`), as the jaxpr path
folds each call of a ``jit`` with its own operands. A function called once keeps its body
(its arguments are known through the call already: ``module.entering_value``), unless a
fold crosses its boundary — a layer inside whose output the caller scales per channel, or
the other way round (:func:`inline_crossed_calls`, the rule of :mod:`hlofold._fold.core.boundary`
that the jaxpr path applies to ``jit`` calls too).
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._fold.core.boundary import AFFINE, LAYER, PASS, crosses, made_by, read_by
from hlofold._ir.stablehlo.ir import ROOTS, SHAPE_KIND, op_name, owner_op, readers
from hlofold._ir.stablehlo.module import walk
from .loops import clone
from hlofold._ir.stablehlo.module import (call_sites, functions, is_private, main_function,
                                          private_body)

ir, stablehlo, func_dialect = C.mlir()


def _holds_root(fop) -> bool:
    return any(op_name(o) in ROOTS for b in fop.regions[0].blocks for o in walk(b))


def inline_weighted_calls(module, ev) -> int:
    """Inline each call of a private function holding a conv/dot that is called more than
    once, where the call passes a known float array (``ev``: the module's evaluator).
    Returns how many calls were inlined."""
    symbols = functions(module)
    holding = {name for name, fop in symbols.items() if _private_with_root(fop)}
    if not holding:          # (no function to inline: the module's calls are not walked)
        return 0
    n = 0
    for name, calls in call_sites(module).items():
        fop = symbols.get(name)
        if name not in holding or len(calls) < 2:
            continue
        for call in calls:
            if not any(np.ndim(v) for a in call.operands if (v := ev(a)) is not None):
                continue
            inline_call(call, fop, symbols)
            n += 1
    if n:
        ev.memo.clear()
    return n


def inline_call(call, fop, symbols: dict) -> None:
    """Replace ``call`` by a copy of the body of ``fop``, its callee."""
    body = fop.regions[0].blocks[0]
    mapping = dict(zip(body.arguments, call.operands))
    ops = list(body.operations)
    with ir.InsertionPoint(call):
        clone(ops[:-1], mapping, symbols)
    for r, v in zip(call.results, ops[-1].operands):
        r.replace_all_uses_with(mapping.get(v, v))
    call.erase()


def _kind(op) -> str | None:
    name = op_name(op)
    return LAYER if name in ROOTS else AFFINE if name in _AFFINE else \
        PASS if name in SHAPE_KIND else None


_AFFINE = ops.names(lambda o: o.affine is not None)


def _readers(v) -> list:                  # (None: returned)
    return [None if op_name(op) == "func.return" else op for op, _ in readers(v)]


def _first(op):
    return op.operands[0]


def _through(op, v):
    """A private call nested in a body: the value its body returns for ``v``."""
    if op_name(op) != "func.call":
        return None
    body = private_body(op)
    if body is None:
        return None
    ret = list(body.operations)[-1]
    return ret.operands[ir.OpResult(v).result_number], owner_op


def _result(op):
    return op.results[0]


def inline_crossed_calls(module) -> int:
    """Inline each call of a private function that a fold crosses
    (:func:`hlofold._fold.core.boundary.crosses`): a layer inside (or in a call inside) whose
    result the caller scales per channel, per-channel arithmetic before a call whose body
    holds the layer, or inside one whose result layers read (a norm's scale) — as the
    jaxpr path inlines such a ``jit`` call (``_fold.jaxpr.nested.crossed_calls``). Calls inside
    bodies brought up by inlining are looked at again. Returns how many were inlined."""
    def crossed(symbols):
        # (a layer in a private function, or one called from one; per-channel arithmetic
        # in a private function whose result layers read: no such function, no walk)
        rooted = {n: _holds_root(f) for n, f in symbols.items() if f.regions[0].blocks}
        if not any(is_private(f) for f in symbols.values()) or not any(rooted.values()):
            return
        for name, calls in call_sites(module).items():
            fop = symbols.get(name)
            if fop is None or not is_private(fop) or not fop.regions[0].blocks:
                continue
            body = fop.regions[0].blocks[0]
            ret = list(body.operations)[-1]
            # (per-channel arithmetic of the caller's layer in a body without one is
            # followed by the chain walk, into the call: only what the body returns counts)
            for call in calls:
                pairs = [(made_by(a, owner_op, _kind, _first, _through),
                          read_by(b, _readers, _kind, _result))
                         for a, b in zip(call.operands, body.arguments)] if rooted[name] else []
                pairs += [(made_by(o, owner_op, _kind, _first, _through),
                           read_by(r, _readers, _kind, _result))
                          for r, o in zip(call.results, ret.operands)]
                if crosses(pairs):
                    yield call, fop
    return _inline_rounds(module, 4, crossed)


def inline_layer_calls(module) -> int:
    """Inline every call in ``@main`` of a private function holding a conv/dot, and the
    calls those bring up: the layers of ``@jax.jit`` helpers read where they are called, so
    that they pair with those around them (``equalize=``, ``smooth=``) as on the jaxpr path,
    which reads calls inlined (``_fold.jaxpr.nested.inline_all``). Returns how many."""
    main = main_function(module)

    def in_main(symbols):
        for op in main.regions[0].blocks[0].operations:
            if op_name(op) == "func.call":
                fop = symbols.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
                if _private_with_root(fop):
                    yield op, fop
    return _inline_rounds(module, 16, in_main)


def _inline_rounds(module, rounds: int, pick) -> int:
    """Inline the calls ``pick(symbols)`` gives, again over what that brings up, for at most
    ``rounds`` rounds; returns how many."""
    n = 0
    for _ in range(rounds):
        symbols = functions(module)
        todo = list(pick(symbols))
        if not todo:
            break
        for call, fop in todo:
            inline_call(call, fop, symbols)
        n += len(todo)
    return n


def _private_with_root(fop) -> bool:
    return is_private(fop) and _holds_root(fop)
