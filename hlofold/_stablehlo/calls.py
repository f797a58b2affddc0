"""Private functions called once per layer, each call with that layer's weights.

A ``@jax.jit`` block called per layer lowers to one private function and a ``func.call`` of
it per layer, the layer's weights (constants of the caller, or bound by ``params=``) as
operands. Inside the function those are block arguments, known at no single call: so a
function that holds a convolution or dot and is called more than once with a known float
operand is inlined at each of those calls (:func:`inline_weighted_calls`), as the jaxpr path
folds each call of a ``jit`` with its own operands. A function called once keeps its body
(its arguments are known through the call already: ``module.entering_value``).
"""
from __future__ import annotations

import numpy as np

from .. import _compat as C
from .ir import ROOTS, op_name
from .loops import clone, walk
from .module import call_sites

ir, stablehlo, func_dialect = C.mlir()


def _holds_root(fop) -> bool:
    return any(op_name(o) in ROOTS for b in fop.regions[0].blocks for o in walk(b))


def inline_weighted_calls(module, ev) -> int:
    """Inline each call of a private function holding a conv/dot that is called more than
    once, where the call passes a known float array (``ev``: the module's evaluator).
    Returns how many calls were inlined."""
    symbols = {ir.StringAttr(op.attributes["sym_name"]).value: op
               for op in module.body.operations if op_name(op) == "func.func"}
    holding = {name for name, fop in symbols.items() if fop.regions[0].blocks and
               "sym_visibility" in fop.attributes and
               ir.StringAttr(fop.attributes["sym_visibility"]).value == "private" and
               _holds_root(fop)}
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
            body = fop.regions[0].blocks[0]
            mapping = dict(zip(body.arguments, call.operands))
            ops = list(body.operations)
            with ir.InsertionPoint(call):
                clone(ops[:-1], mapping, symbols)
            for r, v in zip(call.results, ops[-1].operands):
                r.replace_all_uses_with(mapping.get(v, v))
            call.erase()
            n += 1
    if n:
        ev.memo.clear()
    return n
