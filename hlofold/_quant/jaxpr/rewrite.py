"""The quantization rewrites of a parameter tree — ``fold_params(..., equalize=True)``,
``smooth=[inputs...]``, ``rotate=True`` — as :class:`JaxprView`, the jaxpr adapter's view
the driver (:func:`hlofold._quant.core.rewrites.run`) applies them to.

The pairs are read from the model's jaxpr (:mod:`hlofold._quant.jaxpr.pairs`), the scales
computed by the core (:mod:`hlofold._quant.core.equalize`) in float64 from the leaves' values
(and, to smooth, from the activations the calibration inputs give where the second layers
read them), and each changed leaf rounded once to its dtype. The unchanged model computes
the same outputs with the new leaves (the caller checks it).
"""
from __future__ import annotations

import collections.abc
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hlofold import _compat as C
from hlofold._base.reasons import Reason
from hlofold._quant.core.equalize import EqualizedPair, NotEqualized, equalize, exact_in, record
from hlofold._quant.core.smooth import Observed, check_alpha, check_calibration, smooth
from hlofold._base.channel_axes import Mapped
from hlofold._quant.core.layer_pairs import by_layer
from hlofold._quant.core.rotation import Rotation, orthogonal, rotate
from hlofold._quant.core.pair_walk import Found, Refused
from .pairs import find_pairs
from .residual import find_streams
from .scan_pairs import (LOOP_LAYERS, NESTED_LAYERS, ScanPairs, calibration_run, loop_layers,
                         scan_pairs)
from .rotate import find_stream


def _where(eqn) -> str:
    file, line, _ = C.user_location(eqn)
    return f"{file}:{line}" if file else C.name_stack(eqn) or eqn.primitive.name


def _float_pairs(found, refused, leaves):
    ok = []
    for f in found:
        if all(jnp.issubdtype(leaves.dtype(k), jnp.floating) for k in f.pair.keys()):
            ok.append(f)
        else:
            refused.append(Refused(f.pair.first, f.at, Reason(
                "pair-not-float", "a weight that is not floating point")))
    return ok


def _records(ok, done, paths, where="", kind="equalized"):
    return [record(d, paths[int(f.pair.first)], [paths[int(s.key)] for s in f.pair.seconds],
                   [paths[int(b)] for b, _ in f.pair.biases], _where(f.at) + where, kind,
                   [paths[int(w)] for w, _ in f.pair.writers])
            for f, d in zip(ok, done)]


def _left(refused, paths, jaxpr=None):
    """The starts refused, and (``jaxpr``) the layers of its while loops, with the reasons."""
    return [NotEqualized(paths[int(r.key)], ("" if r.at is None else _where(r.at)) + r.where,
                         r.reason) for r in refused] + [
        NotEqualized("the layers of a loop", _where(e),
                     Reason("pair-loop", LOOP_LAYERS.format(n=n)))
        if e.primitive.name == "while" else
        NotEqualized(f"the layers of a {e.primitive.name}", _where(e),
                     Reason("pair-loop", NESTED_LAYERS.format(n=n, what=e.primitive.name)))
        for e, n in (loop_layers(jaxpr) if jaxpr is not None else [])]


class HostLeaves(collections.abc.Sequence):
    """The caller's live leaves (``place`` replaces them as they are rewritten), each read
    on the host when asked (by index, or by a pair's key: the index as a string): nothing
    here holds a leaf another rewrite has replaced."""

    def __init__(self, live: list, host):
        self.live, self.host = live, host

    def __getitem__(self, i):
        return self.host(self.live[int(i)])

    def __len__(self) -> int:
        return len(self.live)

    def dtype(self, i) -> np.dtype:
        """A leaf's dtype, without reading it onto the host."""
        return np.dtype(self.live[int(i)].dtype)


@dataclasses.dataclass
class _Group:
    """Pairs rewritten together: those of the top level (``scan`` None), or of one scan's
    body — layer by layer (``layers``) or, their leaves shared by every layer, as a whole."""

    found: list
    layers: int | None = None
    scan: ScanPairs | None = None
    where: str = ""

    def pairs(self) -> list:
        return [f.pair for f in self.found]

    def pow2(self, leaves: "HostLeaves") -> bool:
        """Whether a weight is of a low-precision float (bfloat16), or the layers compute in
        one (a float32 weight cast to bfloat16): then every scale is a power of two, and
        the rescaled weights — and what the model computes from them — are exact."""
        return any(f.low or any(exact_in(leaves.dtype(k)) for k in f.pair.keys())
                   for f in self.found)


def _groups(jaxpr, leaves: HostLeaves, norms: bool) -> tuple[list[_Group], list]:
    """The pairs of the top level and of each top-level scan's body; the refusals."""
    found, refused = find_pairs(jaxpr, len(leaves), norms=norms)
    if not norms:                    # (residual streams: equalized, not smoothed)
        found = found + find_streams(jaxpr, len(leaves), found, refused)
    groups = [_Group(_float_pairs(found, refused, leaves))]
    for sp in scan_pairs(jaxpr, len(leaves), norms):
        refused += sp.refused
        groups.append(_Group(_float_pairs(sp.shared, refused, leaves), None, sp,
                             " (in a scanned stack: one scale for every layer)"))
        groups.append(_Group(_float_pairs(sp.stacked, refused, leaves), sp.layers, sp,
                             f" (in a scanned stack: each of its {sp.layers} layers its "
                             f"own scales)"))
    return [g for g in groups if g.found], refused


def _rows_of(leaves: HostLeaves, pairs: list) -> dict:
    return {k: leaves[k] for p in pairs for k in p.keys()}


def equalize_leaves(jaxpr, leaves: HostLeaves, paths: list[str]
                    ) -> tuple[dict, list[EqualizedPair], list[NotEqualized]]:
    """The new values (leaf index -> array of the leaf's dtype) of the leaves the pairs of
    ``jaxpr`` (its first inputs: ``leaves``) scale — those of scanned stacks layer by
    layer; what was equalized; what was not and why."""
    groups, refused = _groups(jaxpr, leaves, norms=False)
    out, recs = {}, []
    for g in groups:
        pairs, pow2 = g.pairs(), g.pow2(leaves)
        if g.layers is None:
            new, done = equalize(leaves, pairs, pow2)
            out.update({int(k): v.astype(leaves.dtype(k)) for k, v in new.items()})
        else:
            done = by_layer(_rows_of(leaves, pairs), g.layers,
                            lambda rows, _: equalize(rows, pairs, pow2), leaves.dtype,
                            lambda k, v: out.__setitem__(int(k), v))
        recs += _records(g.found, done, paths, g.where)
    return out, recs, _left(refused, paths, jaxpr)


def _shifted(axis):
    """A body value's channel axis in its rows stacked over the layers."""
    if isinstance(axis, Mapped):
        return axis.shifted(1)
    return tuple(a + 1 for a in axis) if isinstance(axis, tuple) else axis + 1


def _shapes(xs) -> tuple:
    """The shapes of values, or of a jaxpr's variables: a calibration input's signature."""
    return tuple(tuple(x.aval.shape) if isinstance(x, C.Var) else tuple(np.shape(x))
                 for x in xs)


def _run_at(closed, top: list[Found], scans: dict, retrace, args: list, n: int):
    """:func:`calibration_run` for a calibration input of other shapes than the example's:
    the program traced at its shapes (``retrace``), each pair's end found at its place —
    the same equations, in the same order, only their shapes differ — or a clear error
    where the program is another at those shapes."""
    why = None
    if retrace is None:
        why = "no program to trace at them"
    else:
        other = retrace(args)
        a, b = closed.jaxpr, other.jaxpr
        if [e.primitive.name for e in a.eqns] != [e.primitive.name for e in b.eqns]:
            why = "the program traced at them is another one (other equations)"
        else:
            place = _places(a)
            top2 = [dataclasses.replace(f, end=_at(b, place[f.end])) for f in top]
            scans2 = {}
            for i, (body, found) in scans.items():
                body2 = C.as_closed(C.scan_body(b.eqns[i])[0])
                if [e.primitive.name for e in body.jaxpr.eqns] != \
                        [e.primitive.name for e in body2.jaxpr.eqns]:
                    why = "a scan's body traced at them is another one"
                    break
                inner = _places(body.jaxpr)
                scans2[i] = (body2, [dataclasses.replace(f, end=_at(body2.jaxpr, inner[f.end]))
                                     for f in found])
            if why is None:
                return calibration_run(other, top2, scans2)
    raise ValueError(f"hlofold.fold_params: smooth= input {n} has shapes "
                     f"{list(_shapes(args))} unlike the example's, and {why}: give "
                     f"calibration inputs the program runs the same at")


def _places(jaxpr) -> dict:
    """Each variable of ``jaxpr`` -> where it is: ``("in", k)`` or ``(equation, output)``."""
    out = {v: ("in", k) for k, v in enumerate(jaxpr.invars)}
    for i, e in enumerate(jaxpr.eqns):
        out.update({v: (i, j) for j, v in enumerate(e.outvars)})
    return out


def _at(jaxpr, place):
    return jaxpr.invars[place[1]] if place[0] == "in" else jaxpr.eqns[place[0]].outvars[place[1]]


def smooth_leaves(closed, leaves: HostLeaves, paths: list[str], calibration: list,
                  alpha: float, place, retrace=None
                  ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """SmoothQuant's scales moved into the model: each norm's γ (and β) or layer's output
    channels divided, the layers reading them multiplied, by ``s_j = max|X_j|^α /
    max|W_j|^(1−α)`` where ``X`` is what those layers read on the ``calibration`` inputs
    (each a list of the program's non-parameter input leaves), the calibration running the
    live leaves as they are; in a scanned stack, each layer by its own rows and
    activations. Each pair's leaves are read when it comes to them and placed (``place(i,
    value)``) when it is done."""
    groups, refused = _groups(closed.jaxpr, leaves, norms=True)
    if not groups:
        return [], _left(refused, paths, closed.jaxpr)
    scans: dict = {}
    for g in groups:
        if g.scan is not None:
            scans.setdefault(g.scan.index, (g.scan.body, []))[1].extend(g.found)
    top = [f for g in groups if g.scan is None for f in g.found]
    runs = {_shapes(closed.jaxpr.invars[len(leaves):]):  # (outputs in ``groups``' order)
            calibration_run(closed, top, scans)}
    seen = [[[Observed.for_alpha(alpha) for _ in range(g.layers)] if g.layers else
              Observed.for_alpha(alpha)
             for _ in g.found] for g in groups]
    for n, args in enumerate(calibration):
        key = _shapes(args)
        if key not in runs:        # another batch or length: the program traced at it
            runs[key] = _run_at(closed, top, scans, retrace, args, n)
        run, consts = runs[key]
        got = iter(run(*consts, *leaves.live, *args))
        for g, obs in zip(groups, seen):
            for f, o in zip(g.found, obs):
                x = np.asarray(next(got))
                if g.layers:
                    for layer, ol in enumerate(o):
                        ol.add(x[layer], f.end_axis)
                else:
                    o.add(x, f.end_axis if g.scan is None else _shifted(f.end_axis))
    recs = []
    for g, obs in zip(groups, seen):
        pairs, pow2 = g.pairs(), g.pow2(leaves)
        if g.layers is None:          # (rounded per pair)
            _, done = smooth(leaves, pairs, obs, alpha,
                             store=lambda k, v: place(int(k), v.astype(leaves.dtype(k))),
                             pow2=pow2)
        else:
            done = by_layer(_rows_of(leaves, pairs), g.layers,
                            lambda rows, layer: smooth(rows, pairs, [o[layer] for o in obs],
                                                       alpha, pow2=pow2),
                            leaves.dtype, lambda k, v: place(int(k), v))
        recs += _records(g.found, done, paths, g.where, "smoothed")
    return recs, _left(refused, paths, closed.jaxpr)


def rotate_leaves(jaxpr, leaves, paths: list[str], seed: int, place) -> Rotation:
    """The residual stream rotated: each leaf it changes handed to ``place(i, value)`` as it
    is made (one rotated leaf on the host at a time); the record, or why not."""
    s = find_stream(jaxpr, len(leaves))
    if isinstance(s, str):
        return Rotation(s)
    moved = [s.embedding, *s.readers, *s.writers, *s.shifts]
    low = [i for i in [*s.scales, *(j for j, _ in moved)] if exact_in(leaves.dtype(i))]
    if low:
        return Rotation(f"{paths[low[0]]} is {leaves.dtype(low[0]).name}: a rotation "
                            f"rounds every weight it touches in that dtype (not exact); "
                            f"rotate the float32 weights and cast after")
    for i in s.scales:
        g = np.asarray(leaves[i])
        if g.size and not np.all(g == g.reshape(-1)[0]):
            return Rotation(f"{paths[i]} varies per channel where the stream needs one "
                                f"value for every channel (a norm's γ not folded: "
                                f"fold_params folds it where all its readers fold)")
    todo = moved
    if len({i for i, _ in todo}) < len(todo):
        return Rotation("a weight both reads and writes the stream")
    for i, axis in todo:
        a = np.asarray(leaves[i])
        if not np.issubdtype(a.dtype, np.floating) or a.shape[axis] != s.width:
            return Rotation(f"{paths[i]} is not a float weight over the stream's "
                                f"channels")
    q, kind = orthogonal(s.width, seed, keep_ones=s.centered)
    for i, axis in todo:
        place(i, rotate(np.asarray(leaves[i]), axis, q))
    return Rotation(None, s.width, kind, paths[s.embedding[0]],
                    [paths[i] for i, _ in s.readers], [paths[i] for i, _ in s.writers],
                    [paths[i] for i, _ in s.shifts])


def calibration_inputs(smooth, n_args: int, alpha: float) -> list | None:
    """``smooth=``'s calibration inputs as lists of the model's argument leaves (each item
    the ``args`` of a call, or one array for a one-argument model); a clear error else (or
    for an ``alpha`` outside [0, 1])."""
    if smooth is None:
        return None
    check_alpha(alpha, "hlofold.fold_params")
    calib = [jax.tree.leaves(c if isinstance(c, tuple) else (c,))
             for c in check_calibration(smooth, "hlofold.fold_params")]
    if not calib or any(len(c) != n_args for c in calib):
        raise ValueError("hlofold.fold_params: each smooth= input must be the model's "
                         f"arguments after params ({n_args} array(s)); got "
                         f"{[len(c) for c in calib] or 'none'}")
    return calib


class JaxprView:
    """The rewrites' view of a parameter tree read through the model's jaxpr
    (:class:`~hlofold._quant.core.rewrites.RewriteView`): ``closed``, the program as read
    (:func:`~hlofold._fold.jaxpr.nested.inline_all`); ``leaves``, its parameter leaves,
    changed through ``place(i, value)``; ``host(leaf)``, a leaf's value on the host;
    ``retrace(args)``, the program as read at other argument shapes (calibration inputs of
    other shapes). Each rewrite runs on the leaves as the one before it left them."""

    def __init__(self, closed, leaves: list, paths: list[str], place, host, retrace=None):
        self.closed, self.paths, self.place, self.retrace = closed, paths, place, retrace
        self.leaves = HostLeaves(leaves, host)   # (each leaf read when a rewrite asks)

    def rotate(self, seed: int) -> Rotation:
        return rotate_leaves(self.closed.jaxpr, self.leaves, self.paths, seed, self.place)

    def equalize(self) -> tuple[list, list]:
        got, done, left = equalize_leaves(self.closed.jaxpr, self.leaves, self.paths)
        for i, val in got.items():
            self.place(i, val)
        return done, left

    def smooth(self, calibration: list, alpha) -> tuple[list, list]:
        return smooth_leaves(self.closed, self.leaves, self.paths, calibration, alpha,
                             self.place, self.retrace)
