"""Cross-layer equalization of a parameter tree: ``fold_params(..., equalize=True)``.

The pairs are read from the model's jaxpr (:mod:`hlofold._jaxpr.pairs`), the scales
computed by the core (:mod:`hlofold._core.equalize`) in float64 from the leaves' values,
and each changed leaf rounded once to its dtype. The unchanged model computes the same
outputs with the new leaves (the caller checks it); a per-tensor quantizer then finds the
channels of each kernel in ranges alike.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _compat as C
from ._core.equalize import equalize, spread
from ._jaxpr.pairs import Refused, find_pairs


@dataclasses.dataclass
class EqualizedPair:
    """Two layers equalized: the kernels' pytree paths, the biases divided with the first,
    and each kernel's output-channel spread (largest channel range / the median one: what a
    per-tensor quantizer suffers) before and after."""

    first: str
    second: str
    biases: list[str]
    location: str
    spread_before: tuple[float, float]
    spread_after: tuple[float, float]


@dataclasses.dataclass
class NotEqualized:
    """A layer whose output was not equalized with a next layer, and why."""

    kernel: str
    location: str
    reason: str


def _where(eqn) -> str:
    file, line, _ = C.user_location(eqn)
    return f"{file}:{line}" if file else C.name_stack(eqn) or eqn.primitive.name


def equalize_leaves(jaxpr, leaves: list, paths: list[str]
                    ) -> tuple[dict, list[EqualizedPair], list[NotEqualized]]:
    """The new values (leaf index -> array of the leaf's dtype) of the leaves the pairs of
    ``jaxpr`` (its first inputs: ``leaves``, host arrays) scale; what was equalized; what
    was not and why."""
    pairs, refused = find_pairs(jaxpr, len(leaves))
    where = {}
    for e in jaxpr.eqns:           # (each pair's first layer, for the report)
        if e.primitive.name in ("conv_general_dilated", "dot_general"):
            for v in e.invars:
                where.setdefault(v, _where(e))
    loc = {i: where.get(v, "") for i, v in enumerate(jaxpr.invars[:len(leaves)])}
    # a float kernel each; a pair whose leaves are not floating point is left
    ok = []
    for p in pairs:
        keys = [p.first, p.second, *(b for b, _ in p.biases)]
        if all(np.issubdtype(np.asarray(leaves[int(k)]).dtype, np.floating) for k in keys):
            ok.append(p)
        else:
            refused.append(Refused(int(p.first), None, "a weight that is not floating point"))
    values = {str(i): leaves[i] for p in ok
              for i in {int(p.first), int(p.second), *(int(b) for b, _ in p.biases)}}
    new, _ = equalize(values, ok) if ok else ({}, [])
    done = [EqualizedPair(
        paths[int(p.first)], paths[int(p.second)], [paths[int(b)] for b, _ in p.biases],
        loc[int(p.first)],
        (spread(values, p.first, p.out_axis), spread(values, p.second, p.out_axis2)),
        (spread(new, p.first, p.out_axis), spread(new, p.second, p.out_axis2))) for p in ok]
    out = {int(k): v.astype(np.asarray(leaves[int(k)]).dtype) for k, v in new.items()}
    left = [NotEqualized(paths[r.kernel], loc.get(r.kernel, "") if r.eqn is None
                         else _where(r.eqn), r.reason) for r in refused]
    return out, done, left

