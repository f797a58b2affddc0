"""Rotating the residual stream (QuaRot / SpinQuant, the offline part), IR-agnostic.

In a pre-norm decoder whose norms' γ are folded into the layers after them, the residual
stream ``x`` meets only additions, RMS normalization (``x / √mean(x²)``: ``mean(x Q)² =
mean(x²)`` for an orthogonal ``Q``) and the layers that read or write it. Rotating it by
``Q`` changes no output: the embedding becomes ``E·Q``, each layer writing into the stream
``W·Q`` (its output channels), each reading it ``Qᵀ·W`` (its input channels). Outlier
channels of the stream are spread over all channels: per-tensor (or per-token) activation
quantization errs less. ``Q`` is a randomized Hadamard matrix (``diag(±1)·H/√d``) where
``d`` is a power of two, else a random orthogonal matrix (QR of a Gaussian).

LayerNorm centers: it subtracts each token's mean over the channels, ``x − (x·1/d)·1ᵀ``.
That commutes with ``Q`` too where ``Q`` keeps the all-ones direction (``Q·1 = 1``, so
``1ᵀ·Q = 1ᵀ``): the mean of ``x·Q`` is the mean of ``x``, and ``(x − m·1ᵀ)·Q = x·Q − m·1ᵀ``.
For such streams the matrix is followed by the Householder reflection that takes
``1ᵀ·Q/√d`` back to ``1ᵀ/√d`` — still orthogonal, and still spreading every channel over
all (within the directions orthogonal to the mean, the only ones LayerNorm keeps).
"""
from __future__ import annotations

import numpy as np


def orthogonal(d: int, seed: int = 0, keep_ones: bool = False) -> tuple[np.ndarray, str]:
    """``(Q, kind)``: a ``d × d`` orthogonal matrix in float64 and what it is; with
    ``keep_ones``, one with ``Q·1 = 1`` (for streams LayerNorm centers)."""
    rng = np.random.default_rng(seed)
    if d > 0 and d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        signs = rng.choice([-1.0, 1.0], d)
        q, kind = signs[:, None] * h / np.sqrt(d), "randomized Hadamard"
    else:
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q, kind = q * np.sign(np.diag(r))[None, :], "random orthogonal (QR)"
    if not keep_ones:
        return q, kind
    u = np.full(d, 1 / np.sqrt(d))
    v = u @ q - u                       # the reflection I − 2·v·vᵀ/|v|² takes uᵀ·Q to uᵀ
    n = v @ v
    if n > 1e-24:
        q = q - np.outer(q @ v, v) * (2 / n)
    return q, kind + " reflected to keep the all-ones direction (LayerNorm's mean)"


ROWS = 1 << 12          # rows of a weight rotated at once (its float64 part: ROWS × d)


def rotate(w, axis: int, q: np.ndarray, dtype=None) -> np.ndarray:
    """``W`` with its ``axis`` multiplied by ``Q``: ``W·Q`` for the channels a layer writes
    (or an embedding's features), and ``Qᵀ·W`` for the rows a layer reads — the same
    product, ``Σ_i W[.., i, ..]·Q[i, j]`` — exact in float64, rounded once to ``dtype``
    (``W``'s by default), :data:`ROWS` rows at a time (no float64 copy of a large weight)."""
    w = np.asarray(w)
    moved = np.moveaxis(w, axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    out = np.empty(rows.shape, dtype or w.dtype)
    for i in range(0, rows.shape[0], ROWS):
        out[i:i + ROWS] = rows[i:i + ROWS].astype(np.float64) @ q
    return np.moveaxis(out.reshape(moved.shape), -1, axis)
