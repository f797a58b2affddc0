"""Scanned layer stacks on the jaxpr path: a ``scan`` whose scanned operands are known.

``lax.scan`` over stacked parameters (``flax.linen.scan``, ``nnx.scan``, MaxText) runs one body
``L`` times, iteration ``l`` reading slice ``l`` of each scanned operand. When some of those
operands are known (frozen or prepared parameters), :func:`stacked_scan` folds the body once
per layer with its slices known, and restacks the results with the core rule
(``_core.stacks.restack``): the new scan takes the folded kernels and biases as scanned
operands of its own (computed once, for the stack), and its body runs conv + bias. Layers
that do not fold alike leave the scan as it is, with the reason.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _compat as C
from .._core.reasons import Reason
from .._core.rescale import aligned_empty
from .._core.report import REFUSED
from .._core.stacks import Restack, layer_records, layers_differ, mark_layers
from .nested import NewValue, with_leading_consts


def _struct(c) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(c), getattr(c, "dtype", np.asarray(c).dtype))


def _key(closed: C.ClosedJaxpr):
    """A folded body up to the values of its constants."""
    return str(closed.jaxpr), tuple((np.shape(c), str(_struct(c).dtype)) for c in closed.consts)


def _status(rec) -> str:
    return rec.status + (f" ({rec.reason})" if rec.reason else "")


def _differs(first: list, other: list, layer: int) -> str:
    """Where layer ``layer``'s records first differ from layer 0's, for the reason."""
    for a, b in zip(first, other):
        if (a.status, a.reason) != (b.status, b.reason):
            where = f"{a.file}:{a.line}" if a.file else a.scope
            return f"at {where}, layer 0 is {_status(a)} and layer {layer} {_status(b)}"
    return f"layer {layer}'s folded body differs from layer 0's"


def stacked_scan(scope, eqn, label: str) -> tuple | None:
    """The rebuilt ``scan`` (``NESTED_RULES``' ``(params, operands)`` form: the shared
    constants first, the stacked ones as new scanned operands after the others); ``()``
    where its layers do not fold alike (the body folded as usual, records said why) and
    nothing changed; None where no scanned operand is known or nothing folds with them
    (the caller folds the body as usual)."""
    sub, nc = C.scan_body(eqn)
    _, ncarry, length = C.scan_layout(eqn)
    n = len(eqn.invars)
    known = {k: scope.value(eqn.invars[k]) for k in range(nc + ncarry, n)}
    known = {k: np.asarray(v) for k, v in known.items() if v is not None}
    if not known or length < 1:
        return None
    mask = [k < nc for k in range(n)]
    records, body, scopes, kernels = [], None, [], {}
    keep = scope.opts.keep_stacks          # fold_params: the layers' scopes, no new program
    stack = Restack(length)
    for layer in range(length):
        values: list[Any] = [None] * n
        for k, v in known.items():
            values[k] = v[layer]
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
            return _left(scope, eqn, label, _differs(records[0], recs, layer) if layer
                         else why, length)
        del new, values
    scope.sites.extend(layer_records(records, length))
    if keep:
        scope.stacks.append((eqn, scopes))
        return ()
    plan = stack.result()
    shared = [v for _, v in plan.shared]
    tail = [v for _, v in plan.stacked]
    n_sh, n_in = len(shared), len(sub.jaxpr.invars)
    slots = [j for j, _ in plan.shared] + [j for j, _ in plan.stacked]

    def fn(*a):                 # (*shared, *the scan's operands, *stacked slices)
        cv: list[Any] = [None] * len(body.consts)
        for j, v in zip(slots, a[:n_sh] + a[n_sh + n_in:]):
            cv[j] = v
        return C.eval_jaxpr(body.jaxpr, cv, *a[n_sh:n_sh + n_in])

    full = jax.make_jaxpr(fn)(*map(_struct, shared),
                              *[C.shape_struct(v.aval) for v in sub.jaxpr.invars],
                              *[_struct(t[0]) for t in tail])
    # the old stacked parameters the body no longer reads are dropped, not sliced per layer
    ops = [NewValue(v) for v in shared] + list(eqn.invars) + [NewValue(t) for t in tail]
    linear = [False] * n_sh + list(C.scan_linear(eqn.params) or [False] * n) + \
        [False] * len(tail)
    read = {v for e in full.jaxpr.eqns for v in e.invars if isinstance(v, C.Var)} | \
        {v for v in full.jaxpr.outvars if isinstance(v, C.Var)}
    carry = range(n_sh + nc, n_sh + nc + ncarry)
    keep = [k for k, v in enumerate(full.jaxpr.invars) if k in carry or v in read]
    body = C.ClosedJaxpr(full.jaxpr.replace(invars=[full.jaxpr.invars[k] for k in keep]),
                         full.consts)
    num_consts = sum(1 for k in keep if k < n_sh + nc)
    return (C.with_scan_operands(eqn.params, body, num_consts, [linear[k] for k in keep]),
            [ops[k] for k in keep])


def _into_stacks(layer_scope, kernels: dict, layer: int, length: int) -> None:
    """Each folded kernel of one layer's scope moved into a stack of its own (made at
    layer 0), the site keeping a view: fold_params then writes the stack as it is, and
    no layer's kernel is held twice."""
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


def stacked_view(values: list) -> np.ndarray | None:
    """The stack ``values`` (one per layer) are consecutive views of, if they are."""
    base = getattr(values[0], "base", None)
    if not isinstance(base, np.ndarray) or base.shape != (len(values),) + values[0].shape:
        return None
    ok = all(isinstance(v, np.ndarray) and v.base is base and
             v.__array_interface__["data"][0] == base[k].__array_interface__["data"][0]
             and v.strides == base[k].strides for k, v in enumerate(values))
    return base if ok else None


def _left(scope, eqn, label, why: str, length: int):
    """A stack whose layers do not fold alike: folded as a body with its scanned operands
    not known (in the graph where the caller's ``in_graph`` allows), each refusal saying
    why the layers were not folded one by one."""
    sub, nc = C.scan_body(eqn)
    recs: list = []
    new = scope.child(sub, eqn.invars, [k < nc for k in range(len(eqn.invars))], label,
                      sites=recs)
    reason = layers_differ(why)
    for rec in mark_layers(recs, length):
        if rec.status == REFUSED and isinstance(rec.reason, Reason) and \
                rec.reason.kind == "weights-not-known":
            rec.reason = reason
    scope.sites.extend(recs)
    if new is sub:
        return ()
    consts = list(new.consts)
    body = with_leading_consts(new, 0, len(consts), [_struct(c) for c in consts],
                               [C.shape_struct(v.aval) for v in sub.jaxpr.invars])
    return C.with_scan_body(eqn.params, body, len(consts)), 0, consts
