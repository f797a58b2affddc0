"""SmoothQuant's rule (Xiao et al., *SmoothQuant*, ICML 2023), the IR-agnostic part: what the
calibration inputs show where a pair's second layers read (:class:`Observed`: each
channel's largest ``|x|``), and the scales ``s_j = max|X_j|^α / max|W_j|^(1−α)``
(:func:`smoothing`), moved into the model pair by pair (:func:`smooth`) by the algebra of
:mod:`hlofold._quant.core.equalize`."""
from __future__ import annotations

import numpy as np

from hlofold._base.channel_axes import Mapped
from .equalize import (Done, Pair, apply_to, channel_max, input_ranges, own, powers_of_two,
                       spread_of, spreads)
from .smooth_search import Search, choose, evenly, parse, sample


def smoothing(xmax: np.ndarray, wmax: np.ndarray, alpha: float, pow2: bool = False
              ) -> np.ndarray:
    """SmoothQuant's scales ``s = max|X|^α / max|W|^(1−α)`` per channel (``xmax``: the
    largest activation the calibration inputs gave; ``wmax``: the second layers' largest
    input-row entry); 1 where either is zero or not finite; with ``pow2`` each rounded to a
    power of two."""
    ok = (xmax > 0) & (wmax > 0) & np.isfinite(xmax) & np.isfinite(wmax)
    s = np.ones_like(xmax, dtype=np.float64)
    s[ok] = xmax[ok] ** alpha / wmax[ok] ** (1 - alpha)
    return powers_of_two(s) if pow2 else s


def check_alpha(alpha, who: str) -> float | Search:
    """``alpha`` as a float in [0, 1] or a search (``"search:w4a8"``: the α chosen per pair
    for that quantization, :mod:`.smooth_search`), or a clear error naming ``who``."""
    if isinstance(alpha, (int, float, np.floating, np.integer)) and \
            not isinstance(alpha, bool) and 0.0 <= float(alpha) <= 1.0:
        return float(alpha)
    found = parse(alpha)
    if found is not None:
        return found
    raise ValueError(f"{who}: alpha= must be a number from 0 to 1, or \"search:wNaM\" (the "
                     f"α chosen per pair for N-bit weights, 2-8, and M-bit activations, 2-8 "
                     f"or 16: \"search:w4a8\"); got {alpha!r}")


def check_calibration(smooth, who: str) -> list:
    """``smooth=`` as a list of calibration inputs (each a call's ``args``, or one array for
    a one-argument model), or a clear error naming ``who`` (``smooth=True`` gave a raw
    ``TypeError: 'bool' object is not iterable``)."""
    if not isinstance(smooth, (list, tuple)):
        raise TypeError(f"{who}: smooth= takes a list of calibration inputs (each a call's "
                        f"arguments after params, or one array: smooth=[x1, x2]); got "
                        f"{type(smooth).__name__}")
    if not smooth:
        raise ValueError(f"{who}: smooth= needs at least one calibration input")
    return list(smooth)


class Observed:
    """What the calibration inputs gave where a pair's second layers read: each channel's
    largest ``|x|``; for a search of α (``keep``), rows of it too (:data:`.smooth_search.ROWS`,
    evenly over the inputs)."""

    def __init__(self, keep: bool = False):
        self.max, self.keep, self.parts = None, keep, []

    @classmethod
    def for_alpha(cls, alpha) -> "Observed":
        """What smoothing with ``alpha`` needs: rows kept where it is searched."""
        return cls(keep=parse(alpha) is not None)

    def add(self, x, axis) -> None:
        """``x``'s channels along ``axis`` (an axis, a tuple of axes, or channels repeated
        over some: :class:`~hlofold._base.channel_axes.Mapped`)."""
        if isinstance(axis, Mapped):
            m = np.zeros(axis.channels)
            np.maximum.at(m, np.asarray(axis.positions()),
                          channel_max(np.asarray(x), axis.axes).astype(np.float64))
        else:
            m = channel_max(np.asarray(x), axis).astype(np.float64)  # (exact: a max of |x|)
        self.max = m if self.max is None else np.maximum(self.max, m)
        if self.keep:
            r = (sample(x, axis.axes, axis.positions()) if isinstance(axis, Mapped) else
                 sample(x, axis))
            self.parts.append(r)

    @property
    def rows(self) -> np.ndarray:
        """The rows kept, evenly over every input given."""
        return evenly(np.concatenate(self.parts))


def smooth(values: dict, pairs: list[Pair], seen: list[Observed], alpha: float,
           store=None, pow2: bool = False) -> tuple[dict, list[Done]]:
    """Each pair's smoothing scales applied once, pair by pair: only that pair's leaves are
    held in float64 (a 0.5 B decoder's kernels are not all copied at once); ``store(key,
    value)`` takes each new value as its pair is done (and ``values`` is read for the
    next pairs with it: it may read the caller's live leaves, nothing is kept from one
    pair to the next). Returns the new float64 values (``store`` None) and what was done
    to each pair. ``pow2``: every scale a power of two (low-precision weights)."""
    out, done, search = {}, [], parse(alpha)
    for p, x in zip(pairs, seen):
        cur = {k: out.get(k, values[k]) for k in p.keys()}      # (read as they are)
        before = spreads(cur, p)
        xmax = np.asarray(x.max, np.float64)
        wmax = input_ranges(cur, p, len(x.max))
        if search is None:
            a, s = float(alpha), smoothing(xmax, wmax, float(alpha), pow2)
        else:
            a, s, _ = choose(x.rows, xmax, cur, p, search,
                             lambda b: smoothing(xmax, wmax, b, pow2))
        after = {}
        for k in dict.fromkeys(p.keys()):  # one array at a time in float64, handed on
            work = own(cur.pop(k))
            apply_to(k, work, p, s)
            after[k] = spread_of(work, k, p)
            out[k] = work if store is None else store(k, work)
            del work
        done.append(Done(s, before, (after[p.first], after[p.seconds[0].key]), a, pow2,
                         searched=None if search is None else str(search)))
    return out, done
