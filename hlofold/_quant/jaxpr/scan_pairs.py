"""Pairs inside scanned layer stacks (:mod:`hlofold._quant.core.layer_pairs`) read from a jaxpr,
and the calibration run that sees the activations of every layer.

A top-level ``scan`` whose operands are parameter leaves read by it alone: its body's
variables for those operands are the leaves (a scanned operand's: one row per layer; a
constant operand's: the whole leaf, the same in every layer), and the body's pairs are
read by :func:`hlofold._quant.jaxpr.pairs.find_pairs` as at the top level. A pair whose leaves
are all stacked is equalized or smoothed layer by layer; one whose leaves are all shared
is a pair of the whole program (the same scale in every layer); one mixing the two, or
with a leaf read outside the scan too, is refused with the reason.
"""
from __future__ import annotations

import dataclasses

import jax

from hlofold import _compat as C
from hlofold._base.reasons import Reason
from hlofold._quant.core.layer_pairs import OUTSIDE, SHARED
from hlofold._ir.jaxpr.uses import index_uses
from hlofold._quant.core.pair_walk import Found, Refused
from .pairs import find_pairs


@dataclasses.dataclass
class ScanPairs:
    """The pairs of one top-level scan's body: the scan (its index among the top-level
    equations), its inlined body, its length, the leaves it scans (one row per layer);
    the pairs per layer (``stacked``), those of shared leaves, and the refusals."""

    index: int
    body: object
    layers: int
    rows: set
    stacked: list
    shared: list
    refused: list


def scan_pairs(jaxpr, n_leaves: int, norms: bool = False) -> list[ScanPairs]:
    """The pairs of every top-level ``scan`` of ``jaxpr`` (its first ``n_leaves`` inputs are
    the parameter leaves) whose body reads leaves. ``jaxpr``: as read (:func:`.nested.
    inline_all`, which inlines the scan bodies' calls and checkpoints too)."""
    uses, _ = index_uses(jaxpr)
    top = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    out = []
    for at, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "scan":
            continue
        try:
            body, _ = C.scan_body(e)
            nc, ncarry, length = C.scan_layout(e)
        except C.CompatError:
            continue
        body = C.as_closed(body)
        inner = body.jaxpr.invars
        leaves, rows, outside = {}, set(), set()
        for k, a in enumerate(e.invars):
            if not isinstance(a, C.Var) or a not in top or nc <= k < nc + ncarry:
                continue
            leaves[inner[k]] = top[a]
            u = uses.get(a, [])
            if len(u) != 1 or u[0][0] is not e:
                outside.add(top[a])
            if k >= nc + ncarry:
                rows.add(top[a])
        if not leaves:
            continue
        found, refused = find_pairs(body.jaxpr, 0, norms, leaves=leaves,
                                    outputs="an output of the scan's body")
        refused += [Refused(str(i), None, Reason("pair-loop", AT_COUNTER))
                    for v, i in leaves.items()
                    if i not in rows and _read_at_counter(body.jaxpr, v)]
        where = f" (in a scanned stack of {length} layers)"
        for r in refused:
            r.where = where
        sp = ScanPairs(at, body, length, rows, [], [], refused)
        for f in found:
            keys = [int(k) for k in f.pair.keys()]
            why = _why_not(keys, rows, outside)
            if why:
                sp.refused.append(Refused(f.pair.first, f.at, Reason("pair-loop", why), where))
            else:
                (sp.stacked if keys[0] in rows else sp.shared).append(f)
        out.append(sp)
    return out


AT_COUNTER = ("its rows are read at the loop's counter (the fori_loop form): pairs are read "
              "where each layer's weights are the rows the scan slices for it (lax.scan over "
              "the stacked leaves, nn.scan)")


def _read_at_counter(jaxpr, v) -> bool:
    """Whether the body reads rows of ``v`` at a computed index (``params[k][i]``)."""
    return any(v in e.invars[:1] and e.primitive.name in ("dynamic_slice", "gather")
               for e in jaxpr.eqns)


def _why_not(keys: list[int], rows: set, outside: set) -> str | None:
    what = {0: "its kernel"}
    for j, k in enumerate(keys):
        if k in outside:
            return OUTSIDE.format(what=what.get(j, "a weight it scales"))
    if len({k in rows for k in keys}) > 1:
        return SHARED.format(what="a weight of the pair")
    return None


def calibration_run(closed, top: list[Found], scans: dict[int, tuple[object, list[Found]]]):
    """A jitted ``run(*consts, *invars)`` and ``consts`` (``closed``'s constants, hoisted
    as :func:`hlofold._compat.hoist_consts` gives them), ``run`` returning what each pair's second
    layers read: the values of ``top``'s ends, then for each scan of ``scans`` (its index
    -> its body and pairs, in order) its pairs' ends, one row per layer. The program runs
    up to the last equation it needs; the scans among them run by ``lax.scan`` over their
    bodies with those ends as outputs too."""
    hoisted, consts = C.hoist_consts(closed)
    if not scans:          # (no scan to run with extra outputs: the equations as they are)
        return jax.jit(C.jaxpr_as_fun(C.jaxpr_of(hoisted.invars, hoisted.eqns,
                                                 [f.end for f in top]))), consts
    made = {v: i for i, e in enumerate(hoisted.eqns) for v in e.outvars}
    last = max([*scans, *(made.get(f.end, -1) for f in top), -1])

    def run(*args):
        env = dict(zip(hoisted.invars, args))
        read = lambda v: v.val if isinstance(v, C.Literal) else env[v]     # noqa: E731
        rows = []
        for i, e in enumerate(hoisted.eqns[:last + 1]):
            vals = [read(v) for v in e.invars]
            if i in scans:
                outs, ends = _tapped_scan(e, *scans[i], vals)
                rows += ends
            else:
                outs = C.bind_eqn(e, vals)
            env.update(zip(e.outvars, outs))
        return [*(read(f.end) for f in top), *rows]
    return jax.jit(run), consts


def _tapped_scan(eqn, body, found: list[Found], vals: list) -> tuple[list, list]:
    """``eqn`` (a scan) run on ``vals`` by ``lax.scan`` over its (inlined) ``body``,
    which also gives the pairs' ends per layer: ``(the scan's outputs, the ends stacked)``."""
    nc, ncarry, length = C.scan_layout(eqn)
    inner, bconsts = C.hoist_consts(body)
    fun = C.jaxpr_as_fun(C.jaxpr_of(inner.invars, inner.eqns,
                                    [*inner.outvars, *(f.end for f in found)]))
    consts, n_ys = vals[:nc], len(inner.outvars) - ncarry

    def step(carry, xs):
        outs = list(fun(*bconsts, *consts, *carry, *xs))
        return outs[:ncarry], (outs[ncarry:ncarry + n_ys], outs[ncarry + n_ys:])
    carry, (ys, ends) = jax.lax.scan(step, list(vals[nc:nc + ncarry]), list(vals[nc + ncarry:]),
                                     length=length, reverse=C.scan_reverse(eqn))
    return [*carry, *ys], list(ends)


LOOP_LAYERS = ("{n} convolution/dot equation(s) inside this while loop are not paired: pairs are "
               "read at the top level and in the bodies of scans over stacked leaves "
               "(lax.scan, nn.scan)")
NESTED_LAYERS = ("{n} convolution/dot equation(s) inside this {what} are not paired: pairs are "
                 "read at the top level, in jit calls without shardings, checkpoint (remat) "
                 "bodies and the bodies of scans over stacked leaves")


def loop_layers(jaxpr) -> list[tuple[object, int]]:
    """Each top-level equation of ``jaxpr`` (inlined: :func:`.nested.inline_all`) with
    convolutions or dots in a body it holds (a ``while``, ``cond``, ``shard_map``, a jit call
    with shardings; nested bodies too) but a scan's, whose pairs :func:`scan_pairs` reads:
    ``(the equation, how many)``, to be reported as not paired."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            continue
        n, todo = 0, [sub for sub, _ in C.param_jaxprs(e)]
        while todo:
            sub = todo.pop()
            for inner in getattr(sub, "jaxpr", sub).eqns:
                n += inner.primitive.name in ("conv_general_dilated", "dot_general")
                todo.extend(x for x, _ in C.param_jaxprs(inner))
        if n:
            out.append((e, n))
    return out
