"""Cross-layer equalization (Nagel et al., *Data-Free Quantization through Weight
Equalization and Bias Correction*, ICCV 2019), the IR-agnostic part.

A pair is two layers with a positively homogeneous path between them: the first layer's
output channel ``i`` reaches the second layer's input channel ``i`` through ops that commute
with a positive per-channel scale (bias adds whose bias is scaled with it, products,
ReLU, pooling). Dividing the first kernel's output channel ``i`` (and every bias added on
the way) by ``s_i > 0`` and multiplying the second kernel's input channel ``i`` by ``s_i``
computes the same outputs. With the ranges ``r1_i = max|K1[.., i]|`` and
``r2_i = max|K2[i, ..]|``, ``s_i = √(r1_i·r2_i) / r2_i`` gives both the same range
``√(r1_i·r2_i)``: a per-tensor quantizer then spends its levels on every channel alike.
Chains (a layer second in one pair, first in the next) are swept until the scales settle.

A pair may have several second layers (a value read by q, k and v, by gate and up, by the
branches of an inception block): each gets the scale on its input channels, and their
largest entry per channel is the second range. *Smoothing* (SmoothQuant, Xiao et al. 2023)
moves the same kind of scale from activations with outlier channels into the weights after
them: ``s_j = max|X_j|^α / max|W_j|^(1−α)`` (:mod:`.smoothquant`), the first "kernel" then
being the norm's γ in front (with its β as the bias) or a layer's kernel.

Each adapter reads its IR into :class:`Pair` records (which kernel axis is the channel,
and how a grouped second kernel's input channels are laid out); this module computes the
scales and the new values; the adapter writes them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hlofold._base.channel_axes import each
from hlofold._base.reasons import reason_kind

SWEEPS = 50          # chains settle in a few sweeps; this bounds a pathological one
SETTLED = 1e-6       # a sweep whose every scale is within this of 1 ends the iteration


@dataclasses.dataclass(frozen=True)
class Second:
    """A layer after the path: its kernel's key, input-channel axis and output-channel axis,
    with ``groups`` groups (a depthwise layer: as many groups as channels); ``channels``, where
    its input rows read the channels repeated (an output projection after grouped-query
    attention: each query head's rows its kv head's channels), the channel of each row (its
    input axes flat, in order). The input channel may span several axes (a tuple, most
    significant first: an output projection
    contracting (heads, head_dim)); a first kernel's ``out_axis`` too."""

    key: str
    in_axis: int
    out_axis: int
    groups: int = 1
    channels: tuple | None = None    # the channel each input row reads (repeated kv heads)


@dataclasses.dataclass
class Pair:
    """Layers joined by a positively homogeneous path.

    ``first`` names the first kernel (a key of the values given to :func:`equalize`),
    ``out_axis`` its output-channel axis; ``seconds`` the layers reading the path's end.
    ``biases`` are the vectors added on the way, ``(key, axis)``: each is divided by the
    scale along ``axis``. ``writers``: the other layers whose outputs are added into the
    same channels, ``(key, out_axis)`` — a residual stream's (:func:`ranges` takes the
    largest entry over all of them; each is divided alike). ``offset``: the first is
    applied as ``first + offset`` (Gemma's norm, ``x·(1 + scale)``): that sum is what the
    scale divides."""

    first: str
    out_axis: int
    seconds: list
    biases: list = dataclasses.field(default_factory=list)
    writers: list = dataclasses.field(default_factory=list)
    offset: float = 0.0

    def keys(self) -> list[str]:
        return [self.first, *(w for w, _ in self.writers), *(s.key for s in self.seconds),
                *(b for b, _ in self.biases)]


def stops_here(op: str, not_homogeneous: bool, where: str) -> str:
    """Why a pair's path ends at ``op`` (``where``: "on the way", "(inside f)"), in the
    words both adapters use."""
    return f"{op} {where} " + ("is not positively homogeneous" if not_homogeneous else
                                "is not one equalization passes through")


def channel_of(kernel_shape, in_axis: int, out_axis: int, groups: int) -> np.ndarray:
    """For a second kernel of ``groups`` groups: the input channel each (input row, output
    column) entry reads, shaped ``(rows, columns)``. Group ``g`` owns the columns
    ``g·O/G … (g+1)·O/G`` and the input channels ``g·I … (g+1)·I`` (``I`` the kernel's rows)."""
    rows, cols = kernel_shape[in_axis], kernel_shape[out_axis]
    per = cols // groups
    return (np.arange(cols)[None, :] // per) * rows + np.arange(rows)[:, None]


def channel_max(k: np.ndarray, axes) -> np.ndarray:
    """``max|k|`` per channel along ``axes`` (an axis, or a tuple of axes most significant
    first: a multi-head kernel's (heads, head_dim)), over every other axis."""
    ax, k = each(axes), np.asarray(k)
    rest = tuple(a for a in range(k.ndim) if a not in ax)
    if not np.issubdtype(k.dtype, np.floating) or k.size == 0 or not rest:
        a = np.abs(np.moveaxis(k, ax, tuple(range(len(ax)))))
        return a.reshape(int(np.prod(a.shape[:len(ax)])), -1).max(axis=1)
    # reduced in place of the array's own layout: no transposed |k| copy (a 0.5 B decoder's
    # kernels are read this way many times: each pair's spreads before and after, its ranges)
    m = np.maximum(k.max(axis=rest), -k.min(axis=rest))        # (NaN propagates, as |k|'s)
    order = sorted(ax)
    return m.transpose([order.index(a) for a in ax]).reshape(-1)


def along(s: np.ndarray, shape, axes) -> np.ndarray:
    """``s`` (one value per channel along ``axes``) shaped to broadcast against an array of
    ``shape``."""
    ax = each(axes)
    t = s.reshape([shape[a] for a in ax]).transpose(np.argsort(ax))
    full = [1] * len(shape)
    for a in ax:
        full[a] = shape[a]
    return t.reshape(full)


def _two_axes(k: np.ndarray, in_axis: int, out_axis: int) -> np.ndarray:
    """``max|k|`` over every axis but these two, shaped ``(in, out)``."""
    a = np.abs(np.moveaxis(k, (in_axis, out_axis), (0, 1)))
    return a.reshape(a.shape[0], a.shape[1], -1).max(axis=2)


def ranges(values: dict, pair: Pair, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(r1, r2)``: each channel's range in the first kernel's output and in the second
    kernel's input (the largest over a residual stream's writers)."""
    r1 = channel_max(values[pair.first], pair.out_axis).astype(np.float64)
    for w, axis in pair.writers:
        r1 = np.maximum(r1, channel_max(values[w], axis).astype(np.float64))
    return r1, input_ranges(values, pair, channels)


def input_ranges(values: dict, pair: Pair, channels: int) -> np.ndarray:
    """Each channel's largest entry in the second layers' input rows."""
    r2 = np.zeros(channels)
    for sec in pair.seconds:       # (a max of |k| is exact in k's own type: no float64 copy)
        k2 = np.asarray(values[sec.key])
        if sec.channels is not None:
            np.maximum.at(r2, np.asarray(sec.channels),
                          channel_max(k2, sec.in_axis).astype(np.float64))
            continue
        if sec.groups == 1:         # (in_axis: an axis or a tuple of them)
            r2 = np.maximum(r2, channel_max(k2, sec.in_axis).astype(np.float64))
            continue
        m = _two_axes(k2, sec.in_axis, sec.out_axis).astype(np.float64)
        np.maximum.at(r2, channel_of(k2.shape, sec.in_axis, sec.out_axis, sec.groups), m)
    return r2


def scales(r1: np.ndarray, r2: np.ndarray, pow2: bool = False) -> np.ndarray:
    """``s = √(r1·r2) / r2``, 1 where either range is zero (a dead channel stays); with
    ``pow2``, each rounded to the nearest power of two (:func:`powers_of_two`)."""
    ok = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
    s = np.ones_like(r1)
    s[ok] = np.sqrt(r1[ok] * r2[ok]) / r2[ok]
    return powers_of_two(s) if pow2 else s


def powers_of_two(s: np.ndarray) -> np.ndarray:
    """``s`` rounded to the nearest power of two (in log scale). Multiplying and dividing
    by a power of two is exact in every binary float format (short of overflow and
    subnormals), so weights of a low-precision dtype (bfloat16, float16) rescaled by such
    scales are rounded not at all, and the model computes what it computed, bit for bit:
    within √2 of the ideal scale, for no rounding."""
    return np.exp2(np.round(np.log2(s)))


def exact_in(dtype) -> bool:
    """Whether ``dtype`` is a float of fewer than 32 bits (bfloat16, float16): rescaled by
    arbitrary scales its values would round, so its scales are powers of two."""
    dt = np.dtype(dtype)
    return dt.itemsize < 4 and bool(jnp.issubdtype(dt, jnp.floating))


def apply(values: dict, pair: Pair, s: np.ndarray) -> None:
    """Divide the first kernel's output channels and the biases by ``s``; multiply the
    second kernel's input channels by it (``values``: float64 arrays of the caller's own,
    changed in place — no second copy of a large kernel)."""
    for key in dict.fromkeys(pair.keys()):
        apply_to(key, values[key], pair, s)


def apply_to(key: str, k: np.ndarray, pair: Pair, s: np.ndarray) -> None:
    """:func:`apply` for one of the pair's arrays (``key``: in every role it has there),
    ``k`` changed in place."""
    if key == pair.first:
        if pair.offset:              # ((γ + c)/s − c: the product the model computes)
            k += pair.offset
        k /= along(s, k.shape, pair.out_axis)
        if pair.offset:
            k -= pair.offset
    for b, axis in [*pair.writers, *pair.biases]:
        if b == key:
            k /= along(s, k.shape, axis)
    for sec in (sec for sec in pair.seconds if sec.key == key):
        k2 = k
        if sec.channels is not None:
            k2 *= along(s[np.asarray(sec.channels)], k2.shape, sec.in_axis)
            continue
        if sec.groups == 1:
            k2 *= along(s, k2.shape, sec.in_axis)
            continue
        idx = channel_of(k2.shape, sec.in_axis, sec.out_axis, sec.groups)
        k2 *= np.moveaxis(s[idx].reshape(idx.shape + (1,) * (k2.ndim - 2)), (0, 1),
                          (sec.in_axis, sec.out_axis))


def own(x) -> np.ndarray:
    """``x`` as a float64 array of this module's own (:func:`apply` changes it in place)."""
    return np.array(x, dtype=np.float64, copy=True)


@dataclasses.dataclass
class Done:
    """What equalizing or smoothing did to one pair: its total scale, both kernels' channel
    spreads (:func:`spread`) before and after, and (smoothing) the α; (equalizing) the sweeps
    run and the largest change of its scales in the last (under ``SETTLED``: settled)."""

    scale: np.ndarray
    before: tuple
    after: tuple
    alpha: float | None = None
    pow2: bool = False
    sweeps: int | None = None
    moving: float = 0.0
    searched: str | None = None      # smoothing's α chosen per pair for this quantization


def spreads(values: dict, pair: Pair) -> tuple[float, float]:
    """The first kernel's output-channel spread (1 for a vector: a norm's γ) and the first
    second layer's."""
    return (spread_of(values[pair.first], pair.first, pair),
            spread_of(values[pair.seconds[0].key], pair.seconds[0].key, pair))


def spread_of(k, key: str, pair: Pair) -> float | None:
    """:func:`spreads`' figure for the pair's array ``key`` (None for one it does not
    report: the other second layers, the biases)."""
    if key == pair.first:
        return spread(k, pair.out_axis) if np.ndim(k) > 1 else 1.0
    if key == pair.seconds[0].key:
        return spread(k, pair.seconds[0].out_axis)
    return None


def equalize(values: dict, pairs: list[Pair], pow2: bool = False
             ) -> tuple[dict, list[Done]]:
    """Sweep ``pairs`` (in order) until the scales settle. ``values``: key -> array (not
    changed); returns the new float64 values of every key a pair touches, and what was
    done to each pair. ``pow2``: every scale a power of two (low-precision weights)."""
    # The sweeps read only ranges: each array's max |k| over the axes no scale touches (a
    # 3×3 kernel's taps) holds them all, exactly — rescaled, each sweep, in place of the
    # array; the arrays themselves are rescaled once, by each pair's total, at the end.
    keys = scaled_axes(pairs)            # (each array once, whatever pairs it is in)
    work = {k: reduced(values[k], axes) for k, axes in keys.items()}
    before = [spreads(work, p) for p in pairs]
    total = [np.ones(int(np.prod([work[p.first].shape[a] for a in each(p.out_axis)])))
             for p in pairs]
    sweeps, last = 0, [0.0] * len(pairs)          # (each pair's change in the last sweep)
    for sweeps in range(1, SWEEPS + 1):
        for j, p in enumerate(pairs):
            s = scales(*ranges(work, p, len(total[j])), pow2)
            apply(work, p, s)
            total[j] = total[j] * s
            last[j] = float(np.max(np.abs(s - 1.0), initial=0.0))
        if max(last, default=0.0) < SETTLED:
            break
    after = [spreads(work, p) for p in pairs]
    del work
    new = {k: own(values[k]) for k in keys}
    for p, t in zip(pairs, total):
        apply(new, p, t)
    return new, [Done(t, b, a, None, pow2, sweeps, m)
                 for t, b, a, m in zip(total, before, after, last)]


def scaled_axes(pairs: list[Pair]) -> dict:
    """Each array's axes that a pair scales or reads a range or spread along."""
    out = {}
    for p in pairs:
        out.setdefault(p.first, set()).update(each(p.out_axis))
        for key, axis in [*p.writers, *p.biases]:
            out.setdefault(key, set()).update(each(axis))
        for sec in p.seconds:
            out.setdefault(sec.key, set()).update(each(sec.in_axis) + each(sec.out_axis))
    return out


def reduced(k, axes) -> np.ndarray:
    """``max|k|`` over every axis not in ``axes`` (kept, of size 1), in float64."""
    k = np.asarray(k)
    rest = tuple(a for a in range(k.ndim) if a not in axes)
    if not rest or k.size == 0:
        return np.abs(k).astype(np.float64)
    m = np.maximum(k.max(axis=rest, keepdims=True), -k.min(axis=rest, keepdims=True))
    return m.astype(np.float64)


def spread(k: np.ndarray, axis: int) -> float:
    """How unequal a kernel's channels are along ``axis``: the largest channel range over the
    median one (what a per-tensor quantizer suffers)."""
    r = channel_max(k, axis).astype(np.float64)
    med = float(np.median(r))
    return float(r.max() / med) if med > 0 else float("inf")


@dataclasses.dataclass
class EqualizedPair:
    """Layers equalized (or smoothed): the kernels' pytree paths (for smoothing, the first
    is a norm's γ or a layer's kernel), the biases divided with the first, each kernel's
    output-channel spread (largest channel range / the median one: what a per-tensor
    quantizer suffers) before and after, and the scales' range."""

    first: str
    seconds: list[str]
    biases: list[str]
    location: str
    spread_before: tuple[float, float]
    spread_after: tuple[float, float]
    scale_range: tuple[float, float] = (1.0, 1.0)
    kind: str = "equalized"           # or "smoothed"
    alpha: float | tuple | None = None  # smoothed: its α (searched in a stack: by layer)
    powers_of_two: bool = False       # scales rounded to powers of two (bfloat16 weights)
    writers: list = dataclasses.field(default_factory=list)   # a residual stream's others
    sweeps: int | None = None         # equalized: the sweeps run over its pairs
    settled: bool = True              # equalized: its scales settled within those sweeps
    moving: float = 0.0               # the largest change of its scales in the last sweep
    searched: str | None = None       # smoothed, α searched: the quantization it was chosen for

    def alpha_words(self) -> str:
        """The report's words for the α (searched: for what; None there: left unsmoothed)."""
        if self.searched is not None:
            word = lambda a: "none better than unsmoothed" if a is None else f"{a:g}"  # noqa
            got = (", ".join(map(word, self.alpha)) + " by layer"
                   if isinstance(self.alpha, tuple) else word(self.alpha))
            return f"α {got} (searched for {self.searched[len('search:'):]}), "
        return "" if self.alpha is None else f"α {self.alpha:g}, "

    def unsettled(self) -> str:
        """The report's words for sweeps stopped before the scales settled ("" if they
        did): exact either way, but not the fixed point of the rule."""
        return "" if self.settled else (
            f"; not settled after {self.sweeps} sweeps (its scales still moving "
            f"{100 * self.moving:.2g} % a sweep; exact)")


def record(done: Done, first: str, seconds: list, biases: list, location: str,
           kind: str, writers: list = ()) -> EqualizedPair:
    """The report's record of a pair (its kernels named as the adapter names them;
    ``writers``: a residual stream's other writers)."""
    s = done.scale
    rng = (float(np.min(s)), float(np.max(s))) if np.size(s) else (1.0, 1.0)
    return EqualizedPair(first, seconds, biases, location, done.before, done.after, rng, kind,
                         done.alpha, done.pow2, list(writers), done.sweeps,
                         done.sweeps is None or done.moving < SETTLED, done.moving,
                         done.searched)


@dataclasses.dataclass
class NotEqualized:
    """A layer (or norm) whose output was not paired with the layers after it, and why:
    the reason's words and its kind (:data:`hlofold._base.reasons.KINDS`, ``pair-…``), the
    same on both IR paths."""

    kernel: str
    location: str
    reason: str
    kind: str = ""

    def __post_init__(self):
        if not self.kind:
            self.kind = reason_kind(self.reason) or "other"
