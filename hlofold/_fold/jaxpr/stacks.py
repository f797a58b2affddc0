"""Scanned layer stacks on the jaxpr path: a ``scan`` whose scanned operands are known.

``lax.scan`` over stacked parameters (``flax.linen.scan``, ``nnx.scan``, MaxText) runs one body
``L`` times, iteration ``l`` reading slice ``l`` of each scanned operand. When some of those
operands are known (frozen or prepared parameters), :func:`stacked_scan` folds the body once
per layer with its slices known, and restacks the results with the core rule
(``_fold.core.stacks.Restack``): the new scan takes the folded kernels and biases as scanned
operands of its own (computed once, for the stack), and its body runs conv + bias. Layers
that do not fold alike leave the scan to the usual rule (``_fold.jaxpr.nested.scan_rule``),
with the reason.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import is_extended
from hlofold._fold.core.rescale import aligned_empty
from hlofold._fold.core.stacks import Restack, first_difference, layer_records


class NewValue(NamedTuple):
    """An operand of a rebuilt equation that is a new constant of the outer scope."""
    value: Any


def _key(closed: C.ClosedJaxpr):
    """A folded body up to the values of its constants."""
    return str(closed.jaxpr), tuple(str(C.aval_of(c)) for c in closed.consts)


def stacked_scan(scope, eqn, label: str) -> "tuple | str | None":
    """The rebuilt ``scan`` in ``NESTED_RULES``' ``(params, operands)`` form (the shared
    constants first, the stacked ones as new scanned operands after the others); ``()``
    with ``opts.keep_stacks`` (fold_params's plan: the layers' scopes are kept, the program
    is not rebuilt); why its layers do not fold alike (a str); or None where no scanned
    operand is known or nothing folds with them. Where it returns no tuple the caller folds
    the body as usual."""
    sub, nc = C.scan_body(eqn)
    _, ncarry, length = C.scan_layout(eqn)
    n = len(eqn.invars)
    known = {k: scope.value(eqn.invars[k]) for k in range(nc + ncarry, n)}
    known = {k: np.asarray(v) for k, v in known.items()        # (a key: no weight)
             if v is not None and not is_extended(v)}
    # the fori_loop form: known constant stacks read at a counter the loop carries
    # (``params["K"][i]``: ``i`` from a known start by a constant step; any rows, any number
    # of them), alone or beside scanned ones (BatchNorm statistics read at the counter)
    counters = _counters(scope, eqn, sub, nc, ncarry)
    if counters and not any(np.ndim(scope.value(eqn.invars[k])) for k in range(nc)):
        counters = {}
    if not (known or counters) or length < 1:
        return None
    mask = [k < nc for k in range(n)]
    records, body, scopes, kernels = [], None, [], {}
    keep = scope.opts.keep_stacks          # fold_params: the layers' scopes, no new program
    stack = Restack(length)
    reverse = C.scan_reverse(eqn)
    for layer in range(length):
        # row ``layer`` of a scanned operand (the known ones, and the restacked ones made
        # here) is read by iteration ``step``: the last first where the scan runs reversed
        step = length - 1 - layer if reverse else layer
        values: list[Any] = [None] * n
        for k, v in known.items():
            values[k] = v[layer]
        for k, (a, c, dt) in counters.items():       # the counter at that iteration
            values[k] = np.asarray(a + step * c, dt)
        recs: list = []
        new = scope.child(sub, eqn.invars, mask, label, values=values, sites=recs,
                          scopes=scopes if keep else None)
        if layer == 0:
            if new is sub:
                return None          # nothing folds with the slices known
            body = new
        records.append(recs)
        if keep:
            _into_stacks(scopes[-1], kernels, layer, length)
        why = stack.add(_key(new), [] if keep else new.consts)
        if why is not None:
            return first_difference(records[0], recs, layer)
        del new, values
    scope.sites.extend(layer_records(records, length))
    if keep:
        scope.stacks.append((eqn, scopes))
        return ()
    plan = stack.result()
    # the body's constants become inputs: shared ones first, the stacked ones last (scanned)
    j = body.jaxpr
    shared = [j.constvars[i] for i, _ in plan.shared]
    tail = [j.constvars[i] for i, _ in plan.stacked]
    full = j.replace(constvars=[], invars=shared + list(j.invars) + tail)
    ops = ([NewValue(v) for _, v in plan.shared] + list(eqn.invars) +
           [NewValue(v) for _, v in plan.stacked])
    linear = [False] * len(shared) + list(C.scan_linear(eqn.params) or [False] * n) + \
        [False] * len(tail)
    # the old stacked parameters the body no longer reads are dropped, not sliced per layer
    read = {v for e in full.eqns for v in e.invars if isinstance(v, C.Var)} | \
        {v for v in full.outvars if isinstance(v, C.Var)}
    carry = range(len(shared) + nc, len(shared) + nc + ncarry)
    kept = [k for k, v in enumerate(full.invars) if k in carry or v in read]
    new_body = C.closed_jaxpr(full.replace(invars=[full.invars[k] for k in kept]), ())
    num_consts = sum(1 for k in kept if k < len(shared) + nc)
    return (C.with_scan_operands(eqn.params, new_body, num_consts, [linear[k] for k in kept]),
            [ops[k] for k in kept])


def _counters(scope, eqn, sub, nc: int, ncarry: int) -> dict:
    """The integer scalars the scan carries as counters: carry ``k`` from a known start,
    the body returning it plus a literal. ``{operand: (start, step, dtype)}``."""
    out = {}
    body = sub.jaxpr
    for j in range(ncarry):
        k = nc + j
        var, res = body.invars[k], body.outvars[j]
        if var.aval.shape != () or not np.issubdtype(var.aval.dtype, np.integer):
            continue
        start = scope.value(eqn.invars[k])
        prod = next((e for e in body.eqns if res in e.outvars), None)
        if start is None or prod is None or prod.primitive.name != "add":
            continue
        x, y = prod.invars
        lit = y if x is var else x if y is var else None
        if isinstance(lit, C.Literal):
            out[k] = (int(np.asarray(start)), int(np.asarray(lit.val)),
                      np.dtype(var.aval.dtype))
    return out


def _into_stacks(layer_scope, kernels: dict, layer: int, length: int) -> None:
    """Each folded kernel of one layer's scope moved into a stack of its own (made at
    layer 0, aligned as JAX's CPU client aliases), the site keeping a view: fold_params
    then writes the stack as it is (``_fold.core.stacks.stacked_view``), and no layer's kernel
    is held twice."""
    for idx, site in enumerate(layer_scope.site_at_end[i]
                               for i in sorted(layer_scope.site_at_end)):
        kc = site.kernel_const
        if not isinstance(kc, np.ndarray):
            continue
        buf = kernels.get(idx)
        if buf is None and layer == 0:
            buf = kernels[idx] = aligned_empty((length,) + kc.shape, kc.dtype)
        if buf is not None and buf.shape[1:] == kc.shape and buf.dtype == kc.dtype:
            buf[layer] = kc
            site.kernel_const = buf[layer]
