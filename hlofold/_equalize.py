"""Cross-layer equalization and smoothing of a parameter tree: ``fold_params(...,
equalize=True)``, ``fold_params(..., smooth=[inputs...], alpha=0.5)``.

The pairs are read from the model's jaxpr (:mod:`hlofold._jaxpr.pairs`), the scales
computed by the core (:mod:`hlofold._core.equalize`) in float64 from the leaves' values
(and, to smooth, from the activations the calibration inputs give where the second layers
read them), and each changed leaf rounded once to its dtype. The unchanged model computes
the same outputs with the new leaves (the caller checks it).
"""
from __future__ import annotations

import collections.abc
import dataclasses

import jax
import numpy as np

from . import _compat as C
from ._core.equalize import (EqualizedPair, NotEqualized, Observed, check_alpha, equalize,
                             record, smooth)
from ._core.rotation import orthogonal, rotate
from ._jaxpr.nested import inline_calls
from ._jaxpr.pairs import Refused, find_pairs
from ._jaxpr.stream import find_stream


def inlined(closed):
    """``closed`` with its jit calls inlined (bodies within bodies too, up to a depth of
    16): the layers of a ``@jax.jit`` helper pair with those around it."""
    for _ in range(16):
        at = {i for i, e in enumerate(closed.jaxpr.eqns) if C.inlinable_call(e)}
        if not at:
            break
        closed = inline_calls(closed, at)
    return closed


def _where(eqn) -> str:
    file, line, _ = C.user_location(eqn)
    return f"{file}:{line}" if file else C.name_stack(eqn) or eqn.primitive.name


def _float_pairs(found, refused, leaves):
    ok = []
    for f in found:
        if all(np.issubdtype(leaves.dtype(k), np.floating) for k in f.pair.keys()):
            ok.append(f)
        else:
            refused.append(Refused(int(f.pair.first), f.eqn, "a weight that is not floating point"))
    return ok


def _records(ok, done, paths, refused, kind="equalized"):
    recs = [record(d, paths[int(f.pair.first)], [paths[int(s.key)] for s in f.pair.seconds],
                   [paths[int(b)] for b, _ in f.pair.biases], _where(f.eqn), kind)
            for f, d in zip(ok, done)]
    left = [NotEqualized(paths[r.kernel], "" if r.eqn is None else _where(r.eqn), r.reason)
            for r in refused]
    return recs, left


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


def equalize_leaves(jaxpr, leaves: HostLeaves, paths: list[str]
                    ) -> tuple[dict, list[EqualizedPair], list[NotEqualized]]:
    """The new values (leaf index -> array of the leaf's dtype) of the leaves the pairs of
    ``jaxpr`` (its first inputs: ``leaves``, host arrays) scale; what was equalized; what
    was not and why."""
    found, refused = find_pairs(jaxpr, len(leaves))
    ok = _float_pairs(found, refused, leaves)
    values = {k: np.asarray(leaves[int(k)]) for f in ok for k in f.pair.keys()}
    new, done = equalize(values, [f.pair for f in ok]) if ok else ({}, [])
    out = {int(k): v.astype(values[k].dtype) for k, v in new.items()}
    return (out, *_records(ok, done, paths, refused))


def smooth_leaves(closed, leaves: HostLeaves, paths: list[str], calibration: list,
                  alpha: float, place) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """SmoothQuant's scales moved into the model: each norm's γ (and β) or layer's output
    channels divided, the layers reading them multiplied, by ``s_j = max|X_j|^α /
    max|W_j|^(1−α)`` where ``X`` is what those layers read on the ``calibration`` inputs
    (each a list of the program's non-parameter input leaves), the calibration running the
    live leaves as they are. Each pair's leaves are read when it comes to them and placed
    (``place(i, value)``) when it is done."""
    jaxpr = closed.jaxpr
    found, refused = find_pairs(jaxpr, len(leaves), norms=True)
    ok = _float_pairs(found, refused, leaves)
    if not ok:
        return _records([], [], paths, refused, "smoothed")
    hoisted, consts = C.hoist_consts(closed)       # (the same equations and values)
    run = jax.jit(C.jaxpr_as_fun(C.jaxpr_of(hoisted.invars, hoisted.eqns,
                                            [f.end for f in ok])))
    seen = [Observed() for _ in ok]
    for args in calibration:
        for f, x, o in zip(ok, run(*consts, *leaves.live, *args), seen):
            o.add(x, f.end_axis)
    _, done = smooth(leaves, [f.pair for f in ok], seen, alpha,    # (rounded per pair)
                     store=lambda k, v: place(int(k), v.astype(leaves.dtype(k))))
    return _records(ok, done, paths, refused, "smoothed")


@dataclasses.dataclass
class Rotation:
    """The residual stream rotated (``reason`` None) or why not: its width, the matrix, and
    the pytree paths of the embedding, the layers reading it and those writing into it."""

    reason: str | None
    width: int = 0
    kind: str = ""
    embedding: str = ""
    readers: list = dataclasses.field(default_factory=list)
    writers: list = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        if self.reason:
            return f"not rotated: {self.reason}"
        return (f"rotated the residual stream ({self.width} channels, {self.kind}): "
                f"embedding {self.embedding}; {len(self.readers)} layers reading it, "
                f"{len(self.writers)} writing into it")


def rotate_leaves(jaxpr, leaves, paths: list[str], seed: int, place) -> Rotation:
    """The residual stream rotated: each leaf it changes handed to ``place(i, value)`` as it
    is made (one rotated leaf on the host at a time); the record, or why not."""
    s = find_stream(jaxpr, len(leaves))
    if isinstance(s, str):
        return Rotation(s)
    for i in s.scales:
        g = np.asarray(leaves[i])
        if g.size and not np.all(g == g.reshape(-1)[0]):
            return Rotation(f"the norm scale {paths[i]} varies per channel (γ not "
                            f"folded: fold_params folds it where all its readers fold)")
    todo = [s.embedding, *s.readers, *s.writers]
    if len({i for i, _ in todo}) < len(todo):
        return Rotation("a weight both reads and writes the stream")
    for i, axis in todo:
        a = np.asarray(leaves[i])
        if not np.issubdtype(a.dtype, np.floating) or a.shape[axis] != s.width:
            return Rotation(f"{paths[i]} is not a float weight over the stream's channels")
    q, kind = orthogonal(s.width, seed)
    for i, axis in todo:
        place(i, rotate(np.asarray(leaves[i]), axis, q))
    return Rotation(None, s.width, kind, paths[s.embedding[0]],
                    [paths[i] for i, _ in s.readers], [paths[i] for i, _ in s.writers])


def calibration_inputs(smooth, n_args: int, alpha: float) -> list | None:
    """``smooth=``'s calibration inputs as lists of the model's argument leaves (each item
    the ``args`` of a call, or one array for a one-argument model); a clear error else (or
    for an ``alpha`` outside [0, 1])."""
    if smooth is None:
        return None
    check_alpha(alpha, "hlofold.fold_params")
    calib = [jax.tree.leaves(c if isinstance(c, tuple) else (c,)) for c in smooth]
    if not calib or any(len(c) != n_args for c in calib):
        raise ValueError("hlofold.fold_params: each smooth= input must be the model's "
                         f"arguments after params ({n_args} array(s)); got "
                         f"{[len(c) for c in calib] or 'none'}")
    return calib


def rewrite(closed, leaves: list, paths: list[str], place, host, *, equalize: bool,
            smooth: list | None, alpha: float, rotate: bool, seed: int) -> tuple:
    """``fold_params``' rewrites after the fold, in order — the stream rotated (smoothing
    then sees rotated channels), pairs equalized, then smoothed — each on the leaves as the
    one before left them (``leaves``: changed through ``place(i, value)``; ``host(leaf)``:
    its value on the host). Returns ``((equalized, not_equalized), rotation)``."""
    eq, rotation = ([], []), None
    if not (rotate or equalize or smooth is not None):
        return eq, rotation
    flat = inlined(closed)
    view = HostLeaves(leaves, host)      # (each leaf read when a rewrite asks for it)
    if rotate:
        rotation = rotate_leaves(flat.jaxpr, view, paths, seed, place)
    if equalize:
        got, *eq = equalize_leaves(flat.jaxpr, view, paths)
        for i, val in got.items():
            place(i, val)
    if smooth is not None:
        done, left = smooth_leaves(flat, view, paths, smooth, alpha, place)
        eq = (eq[0] + done, eq[1] + left)
    return eq, rotation
