"""Cross-layer equalization of a StableHLO function's constants: ``fold_stablehlo(...,
params=, equalize=True)``.

Run after the fold (BatchNorms are in the kernels and biases) and before the weights are
hoisted into arguments: the pairs are read by :mod:`hlofold._stablehlo.pairs`, the scales
computed by the core (:func:`hlofold._core.equalize.equalize`, float64, the same sweeps as
``fold_params(..., equalize=True)``), and each changed constant written anew, rounded once
to its type. The function computes the same outputs (the caller checks it).
"""
from __future__ import annotations

import numpy as np

from .. import _compat as C
from .._core.equalize import EqualizedPair, NotEqualized, equalize, spread
from .ir import dense_to_numpy, elem_type, float_dtype, numpy_to_dense, op_name
from .pairs import ROOTS, Refused, find_pairs, layer, where

ir, stablehlo, _ = C.mlir()


def _name(w, names: dict) -> str:
    got = names.get(w.const)
    if got is None:
        role = "kernel" if w.reader is not None and op_name(w.reader) in ROOTS else "bias"
        got = f"the folded {role} of {layer(w.reader)}" if w.reader is not None else \
            "a constant"
    return got


def equalize_function(func, names: dict | None = None
                      ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Equalize the pairs of ``func`` in place; ``names``: constant op -> what the user calls
    it (``"arg3"``: a bound argument). Returns what was equalized and what was not, why."""
    names = names or {}
    found, refused, weights = find_pairs(func)
    values, ok = {}, []
    for f in found:
        got = {k: dense_to_numpy(weights[k].const.attributes["value"]) for k in f.pair.keys()}
        if any(v is None or float_dtype(elem_type(weights[k].const.results[0])) is None
               for k, v in got.items()):
            refused.append(Refused(f.pair.first, f.op, "a weight that is not floating point "
                                   "(or not readable)"))
            continue
        values.update(got)
        ok.append(f)
    left = [NotEqualized(_name(weights[r.key], names) if r.key else "a layer's kernel",
                         where(r.op), r.reason) for r in refused]
    for f in ok:
        f.location = where(f.op)
    if not ok:
        return [], left
    called = {k: _name(w, names) for k, w in weights.items()}    # (before a write)
    new, scales = equalize(values, [f.pair for f in ok])
    rounded = {k: v.astype(values[k].dtype) for k, v in new.items()}
    for k, v in rounded.items():
        old = weights[k].const
        with ir.InsertionPoint(old):
            c = stablehlo.ConstantOp(numpy_to_dense(v, elem_type(old.results[0]), given=True))
        old.results[0].replace_all_uses_with(c.result)
        old.erase()

    def sp(vals, p):
        first = spread(vals, p.first, p.out_axis) if vals[p.first].ndim > 1 else 1.0
        return first, spread(vals, p.seconds[0].key, p.seconds[0].out_axis)
    done = [EqualizedPair(called[f.pair.first], [called[s.key] for s in f.pair.seconds],
                          [called[b] for b, _ in f.pair.biases], f.location,
                          sp(values, f.pair), sp(new, f.pair),
                          (float(np.min(s)), float(np.max(s))) if np.size(s) else (1.0, 1.0))
            for f, s in zip(ok, scales)]
    return done, left
