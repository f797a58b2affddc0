"""SmoothQuant's α chosen per pair from the calibration inputs (``alpha="search:w4a8"``), as AWQ
(Lin et al., *AWQ*, MLSys 2024) searches its scales: for each α of a grid (and for no
smoothing at all), the pair's second layers are quantized as the target runs them —
weights per output channel, activations per tensor — on rows of what the calibration
inputs gave where they read, and the α whose outputs are nearest the float ones is taken.
Every candidate is exact in float (a positive scale per channel moved across the pair);
the search only chooses among them. IR-agnostic: both adapters call it through
:func:`hlofold._quant.core.smooth.smooth`.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from hlofold._base.channel_axes import each

ROWS = 256                # the calibration rows kept per pair (evenly over the inputs)
GRID = tuple(i / 16 for i in range(17))   # the α a search may take
COARSE = (0.0, 0.25, 0.5, 0.75, 1.0)     # tried first; then halving steps around the best
TIE = 1e-4                # errors this close (relative) are one: the rows left unsmoothed
_SPEC = re.compile(r"search:w([2-8])a([2-8]|16)")


@dataclasses.dataclass(frozen=True)
class Search:
    """``alpha="search:w4a8"`` (int4 weights per output channel, int8 activations per
    tensor), ``"search:w8a8"``, ``"search:w4a16"`` (activations left in float): the
    quantization the α is chosen for."""

    weights: int
    activations: int | None          # None: activations not quantized (``a16``)

    def __str__(self) -> str:
        return f"search:w{self.weights}a{self.activations or 16}"


def parse(alpha) -> Search | None:
    """``alpha`` as a :class:`Search` (a ``"search…"`` string or one already parsed), or
    None (a number: the α itself)."""
    if isinstance(alpha, Search):
        return alpha
    m = _SPEC.fullmatch(alpha) if isinstance(alpha, str) else None
    if m is None:
        return None
    w, a = int(m.group(1)), int(m.group(2))
    return Search(w, None if a == 16 else a)


def sample(x: np.ndarray, axes, positions=None) -> np.ndarray:
    """Up to :data:`ROWS` rows ``(n, channels)`` of ``x`` (channels along ``axes``; where
    they are repeated, ``positions`` gives each position's channel and the first copy is
    kept), evenly spaced over its other axes, as float32."""
    ax = each(axes)
    a = np.moveaxis(np.asarray(x), ax, tuple(range(x.ndim - len(ax), x.ndim)))
    a = a.reshape(-1, int(np.prod([x.shape[i] for i in ax])))
    if positions is not None:
        _, first = np.unique(np.asarray(positions), return_index=True)
        a = a[:, first]
    return evenly(a).astype(np.float32)


def evenly(rows: np.ndarray, n: int = ROWS) -> np.ndarray:
    """At most ``n`` of ``rows``, evenly spaced."""
    if len(rows) <= n:
        return rows
    return rows[np.linspace(0, len(rows) - 1, n).astype(int)]


@functools.partial(jax.jit, static_argnums=4)
def _error(x, w, s, ref, bits: int):
    """``‖x·Q(s·w) − ref‖²``: rows ``w (R, O, K)`` scaled by ``s (R,)``, quantized per
    output channel (axis 1), read by ``x (n, R)`` (one XLA computation: no float temporaries
    of a large kernel per candidate on the host)."""
    ws = w * s[:, None, None]
    q = 2.0 ** (bits - 1) - 1
    m = jnp.max(jnp.abs(ws), axis=(0, 2), keepdims=True)
    step = jnp.where(m > 0, m / q, 1.0)
    wq = jnp.clip(jnp.round(ws / step), -q, q) * step
    return jnp.sum(jnp.square(x @ wq.reshape(w.shape[0], -1) - ref))


class _Layer:
    """A second layer as rows ``(R, O, rest)``, its input rows first, output channels next,
    and the channel each row reads (``chan``). A grouped layer is read as the dense one it
    equals — group ``g``'s rows in channels ``g·R…(g+1)·R`` of its columns, zeros elsewhere
    (a zero changes no output channel's largest entry: the same quantization)."""

    def __init__(self, k: np.ndarray, sec, rows: np.ndarray):
        ins = each(sec.in_axis)
        k = np.moveaxis(np.asarray(k, np.float32), (*ins, sec.out_axis),
                        tuple(range(len(ins) + 1)))
        w = k.reshape(int(np.prod(k.shape[:len(ins)])), k.shape[len(ins)], -1)
        r, o = w.shape[:2]
        if sec.groups > 1:
            dense = np.zeros((r * sec.groups, o, w.shape[2]), np.float32)
            dense[(np.arange(o) // (o // sec.groups)) * r + np.arange(r)[:, None],
                  np.arange(o)] = w
            w, r = dense, r * sec.groups
        self.chan = np.asarray(sec.channels) if sec.channels is not None else np.arange(r)
        self.w = jnp.asarray(w)
        self.ref = jnp.asarray(rows[:, self.chan]) @ self.w.reshape(r, -1)
        self.energy = float(jnp.sum(jnp.square(self.ref)))

    def error(self, x: np.ndarray, s: np.ndarray, bits: int) -> float:
        """The squared error of this layer's outputs on ``x`` (channels already divided by
        ``s``, quantized or not) with its rows times ``s`` quantized to ``bits``."""
        return float(_error(jnp.asarray(x[:, self.chan]), self.w,
                            jnp.asarray(s[self.chan], jnp.float32), self.ref, bits))


def choose(rows: np.ndarray, xmax: np.ndarray, values: dict, pair, search: Search,
           scales) -> tuple[float | None, np.ndarray, dict]:
    """The α of :data:`GRID` (:data:`COARSE` first, then steps halved around the best
    down to the grid's: the error over α has one valley; or None: no smoothing, unless
    an α errs less beyond :data:`TIE`) whose scales ``scales(α)`` give the second layers'
    quantized outputs on ``rows`` nearest their float outputs (the squared error summed
    over them, relative). Returns it, its scales and each candidate's error."""
    c = len(xmax)
    layers = [_Layer(values[sec.key], sec, rows) for sec in pair.seconds]
    norm = sum(lay.energy for lay in layers) or 1.0
    cands, errs = {}, {}

    def error(a):
        if a in errs:
            return errs[a]
        s = cands[a] = np.ones(c) if a is None else scales(a)
        x = rows / s.astype(np.float32)
        if search.activations is not None:
            top = float(np.max(np.where(np.isfinite(xmax), xmax, 0) / s)) if c else 0.0
            q = 2.0 ** (search.activations - 1) - 1
            step = top / q if top > 0 else 1.0
            x = np.clip(np.round(x / step), -q, q) * step
        errs[a] = sum(lay.error(x, s, search.weights) for lay in layers) / norm
        return errs[a]

    best, step = min(COARSE, key=error), 0.25      # (the errors over α: one valley)
    while step > GRID[1]:
        step /= 2
        best = min((best, *(a for a in (best - step, best + step) if 0 <= a <= 1)), key=error)
    error(None)
    if errs[None] <= errs[best] * (1 + TIE):      # an α must beat no smoothing beyond rounding
        best = None
    return best, cands[best], errs
