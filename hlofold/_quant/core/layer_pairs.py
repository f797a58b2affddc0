"""Equalization and smoothing of pairs inside a scanned layer stack, the IR-agnostic part.

A stack of ``L`` layers (``lax.scan`` over stacked parameters: ``flax.linen.scan``,
``nnx.scan``, MaxText) runs one body per layer, layer ``l`` reading row ``l`` of each
stacked leaf. A pair of the body is ``L`` pairs, one per layer: each layer gets its own
scales, computed from its own rows (and, to smooth, its own activations), exactly as an
unrolled model's layers would. Every leaf of such a pair must be stacked: a leaf shared by
all layers (one γ for every layer) cannot take a per-layer scale, and the adapter refuses
the pair (:data:`SHARED`).

:func:`by_layer` runs a rewrite (``equalize`` or ``smooth`` of :mod:`.equalize`) on each
layer's rows and restacks the new rows; :func:`merged` is the report's one record per pair
(the scales of every layer, the widest spreads).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .equalize import Done

SHARED = ("{what} is one value for every scanned layer beside weights stacked per layer "
          "(a per-layer scale cannot be moved into it)")
OUTSIDE = "{what} is read outside the scan too (a shared weight)"


class Rows(Mapping):
    """Row ``layer`` of each stacked value (``values``: key -> array, leading axis the
    layers)."""

    def __init__(self, values: Mapping, layer: int):
        self.values, self.layer = values, layer

    def __getitem__(self, key):
        return self.values[key][self.layer]

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def merged(per_layer: list[Done]) -> Done:
    """One pair's record over its layers: every layer's scales (one row each), the widest
    channel spreads before and after (what the worst layer's per-tensor quantizer sees);
    a searched α, each layer's (a tuple, where they differ)."""
    worst = lambda xs: tuple(max(x[j] for x in xs) for j in range(2))     # noqa: E731
    alphas = tuple(d.alpha for d in per_layer)
    return Done(np.stack([d.scale for d in per_layer]), worst([d.before for d in per_layer]),
                worst([d.after for d in per_layer]),
                alphas[0] if len(set(alphas)) == 1 else alphas, per_layer[0].pow2,
                None if per_layer[0].sweeps is None else max(d.sweeps for d in per_layer),
                max(d.moving for d in per_layer), per_layer[0].searched)


def by_layer(values: Mapping, layers: int,
             step: Callable[[Mapping, int], tuple[dict, list[Done]]],
             dtype_of: Callable[[str], np.dtype], store: Callable[[str, np.ndarray], object]
             ) -> list[Done]:
    """``step(rows, layer)`` (a rewrite of one layer's rows: new float64 rows by key, and
    what was done to each pair) run on every layer; each new stacked value (rows in
    ``dtype_of(key)``, rounded once) handed to ``store(key, value)`` when every layer is
    done. Returns what was done to each pair over all layers (:func:`merged`)."""
    out: dict = {}
    done = []
    for layer in range(layers):
        new, did = step(Rows(values, layer), layer)
        for key, row in new.items():
            if key not in out:
                out[key] = np.empty((layers, *np.shape(row)), dtype_of(key))
            out[key][layer] = row
        done.append(did)
        del new
    for key in list(out):
        store(key, out.pop(key))
    return [merged(list(d)) for d in zip(*done)]
