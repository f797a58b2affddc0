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

import dataclasses

import numpy as np

from hlofold._base.reasons import kinded


class Orthogonal:
    """``Q`` applied to rows, ``x @ Q``: a randomized Hadamard matrix as a fast Walsh–Hadamard
    transform (``d·log d`` per row in place of ``d²``), else a dense matrix; then, where set,
    the reflection ``I − 2·v·vᵀ/|v|²`` (a rank-one update)."""

    __array_ufunc__ = None        # (``ndarray @ Q`` defers to ``Q.__rmatmul__``)

    def __init__(self, d: int, signs=None, dense=None):
        self.d, self.signs, self.matrix = d, signs, dense
        self.v = self.qv = None

    def _base(self, x: np.ndarray) -> np.ndarray:
        """``x`` times ``diag(±1)·H/√d`` (``H`` symmetric), or times the dense matrix."""
        return x @ self.matrix if self.matrix is not None else self._hadamard(x * self.signs)

    def _hadamard(self, x: np.ndarray) -> np.ndarray:
        """``x·H/√d`` by log2(d) stages of ``a ± b``, 64 rows at a time (in cache)."""
        rows = x.reshape(-1, self.d)
        out = np.empty(rows.shape)
        for i in range(0, rows.shape[0], 64):
            y = np.array(rows[i:i + 64], np.float64)
            o = np.empty_like(y)
            h = 1
            while h < self.d:
                a, b = (z.reshape(-1, self.d // (2 * h), 2, h) for z in (y, o))
                np.add(a[:, :, 0], a[:, :, 1], out=b[:, :, 0])
                np.subtract(a[:, :, 0], a[:, :, 1], out=b[:, :, 1])
                y, o, h = o, y, 2 * h
            out[i:i + 64] = y
        return (out / np.sqrt(self.d)).reshape(x.shape)

    def __rmatmul__(self, x) -> np.ndarray:
        x = np.asarray(x, np.float64)
        y = self._base(x)
        if self.v is not None:
            y = y - np.multiply.outer(x @ self.qv, self.v) * (2 / (self.v @ self.v))
        return y

    def keep_ones(self) -> "Orthogonal":
        """The same ``Q`` followed by the reflection taking ``1ᵀ·Q/√d`` to ``1ᵀ/√d``."""
        u = np.full(self.d, 1 / np.sqrt(self.d))
        v = self._base(u) - u
        if v @ v > 1e-24:          # (Q_base·v as a column: diag(±1)·H·v/√d, or M·v)
            self.v = v
            self.qv = self.matrix @ v if self.matrix is not None else \
                self.signs * self._hadamard(v)
        return self

    def dense(self) -> np.ndarray:
        """``Q`` as a matrix (for tests)."""
        return np.eye(self.d) @ self


def orthogonal(d: int, seed: int = 0, keep_ones: bool = False) -> tuple[Orthogonal, str]:
    """``(Q, kind)``: a ``d × d`` orthogonal matrix in float64 (applied as ``rows @ Q``) and
    what it is; with ``keep_ones``, one with ``Q·1 = 1`` (for streams LayerNorm centers)."""
    rng = np.random.default_rng(seed)
    if d > 0 and d & (d - 1) == 0:
        q, kind = Orthogonal(d, signs=rng.choice([-1.0, 1.0], d)), "randomized Hadamard"
    else:
        m, r = np.linalg.qr(rng.standard_normal((d, d)))
        q, kind = Orthogonal(d, dense=m * np.sign(np.diag(r))[None, :]), "random orthogonal (QR)"
    if not keep_ones:
        return q, kind
    return q.keep_ones(), kind + " reflected to keep the all-ones direction (LayerNorm's mean)"


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


@dataclasses.dataclass
class Rotation:
    """The residual stream rotated (``reason`` None) or why not: its width, the matrix, and
    the pytree paths of the embedding, the layers reading it and those writing into it. A
    reason is of kind ``rotation`` (:data:`hlofold._base.reasons.KINDS`) unless it has one."""

    reason: str | None
    width: int = 0
    kind: str = ""
    embedding: str = ""
    readers: list = dataclasses.field(default_factory=list)
    writers: list = dataclasses.field(default_factory=list)
    offsets: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.reason is not None:
            self.reason = kinded("rotation", self.reason)

    def __str__(self) -> str:
        if self.reason:
            return f"not rotated: {self.reason}"
        off = f", {len(self.offsets)} norm offsets (β)" if self.offsets else ""
        return (f"rotated the residual stream ({self.width} channels, {self.kind}): "
                f"embedding {self.embedding}; {len(self.readers)} layers reading it, "
                f"{len(self.writers)} writing into it{off}")
