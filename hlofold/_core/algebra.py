"""The s/t algebra, shared by both IR paths.

A chain of per-channel affine ops after a root collapses into one ``y·s + t``
(:func:`collapse`), and an affine in front of a root into the kernel and a bias
(:func:`group_matrix_np` / :func:`place_np` place a per-input-channel vector on the kernel's
axes, for any feature grouping). The arithmetic is a parameter: NumPy float64 on the host
(:class:`np64`, for values known at transform time), ``lax`` in a trace (:func:`lax_arith`),
or StableHLO ops (``hlofold._stablehlo.fold``). The dtype policy: known values are computed in
float64 and rounded once to the kernel's dtype (``_core.rules.round_kernel``); in the graph the
arithmetic runs in float32, or float64 when the program computes in float64.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class np64:
    """Arithmetic on the host in float64 (all operands known at transform time)."""

    @staticmethod
    def asarray(x):
        return np.asarray(x, np.float64)

    add, sub, mul, div = (np.add, np.subtract, np.multiply, np.divide)
    neg = staticmethod(np.negative)


def kinds(steps) -> list[str]:
    return [st.kind for st in steps]


def has_shift(steps) -> bool:
    """Whether absorbed ``steps`` add to ``t`` (so a bias remains after the fold)."""
    return any(st.kind in ("add", "sub", "rsub") for st in steps)


def collapse(kinds: Sequence[str], vals: list, channels: int, xp=np64):
    """Collapse absorbed ops (``kinds``: add/sub/rsub/mul/div/neg, with operand ``vals``)
    into (s, t): vectors of length ``channels`` or scalars. ``xp`` is the arithmetic: NumPy
    float64 on the host, ``lax`` in a trace, or StableHLO ops (``hlofold._stablehlo.fold``).

    ``None`` stands for the identity (s = 1, t = 0) so no arithmetic is emitted for it.
    """
    s: Any = None
    t: Any = None
    for kind, c in zip(kinds, vals):
        if c is not None:
            c = xp.asarray(c)
        if kind == "add":
            t = c if t is None else xp.add(t, c)
        elif kind == "sub":
            t = xp.neg(c) if t is None else xp.sub(t, c)
        elif kind == "rsub":
            s = xp.asarray(-1.0) if s is None else xp.neg(s)
            t = c if t is None else xp.sub(c, t)
        elif kind == "mul":
            s = c if s is None else xp.mul(s, c)
            t = None if t is None else xp.mul(t, c)
        elif kind == "div":
            s = xp.div(xp.asarray(1.0), c) if s is None else xp.div(s, c)
            t = None if t is None else xp.div(t, c)
        elif kind == "neg":
            s = xp.asarray(-1.0) if s is None else xp.neg(s)
            t = None if t is None else xp.neg(t)
    s = xp.asarray(1.0) if s is None else s
    t = xp.asarray(0.0) if t is None else t
    if xp is np64:
        return (per_channel(s, channels) if np.ndim(s) else np.asarray(s, np.float64),
                per_channel(t, channels) if np.ndim(t) else np.asarray(t, np.float64))
    return s, t


def per_channel(x, channels: int) -> np.ndarray:
    """``x`` (a scalar, or a vector broadcasting to ``channels``) as a float64 vector of length
    ``channels`` (a read-only view where it is broadcast)."""
    x = np.asarray(x, np.float64)
    return x if x.shape == (channels,) else np.broadcast_to(x, (channels,))


def group_matrix_np(vec, out_channels: int, groups: int):
    """Per-input-channel ``vec`` (length C_in, or a scalar) as the (O, C_in/G) matrix of the
    kernel entries it multiplies: output channel o reads the inputs of group o // (O/G)."""
    vec = np.asarray(vec, np.float64)
    if vec.ndim == 0:
        return vec
    return np.repeat(vec.reshape(groups, -1), out_channels // groups, axis=0)


def place_np(m, o_axis: int, i_axis: int, ndim: int):
    """The (O, I) matrix ``m`` shaped to multiply a kernel with those axes."""
    if np.ndim(m) == 0:
        return m
    if o_axis > i_axis:
        m = m.T
    shape = [1] * ndim
    shape[o_axis], shape[i_axis] = (m.shape[0], m.shape[1]) if o_axis < i_axis else \
        (m.shape[1], m.shape[0])
    return m.reshape(shape)


def forward_kernel(k64, s_in, t_in, ko: int, ki: int, groups: int, out_channels: int,
                   bias_map=None):
    """An affine ``x·s_in + t_in`` in front of a root, folded on the host (float64):
    ``(K ⊙_in s_in, b)`` with ``b`` the bias the shift adds, ``Σ K·t_in`` per output channel,
    or ``bias_map(taps)`` (a padded convolution: ``taps`` is the kernel with the input
    features contracted against ``t_in``, that axis kept with size 1)."""
    s2 = group_matrix_np(s_in, out_channels, groups)
    t2 = group_matrix_np(t_in, out_channels, groups)
    w = k64 * place_np(t2, ko, ki, k64.ndim)
    b64 = (np.sum(w, axis=tuple(a for a in range(k64.ndim) if a != ko)) if bias_map is None
           else bias_map(np.sum(w, axis=ki, keepdims=True)))
    return k64 * place_np(s2, ko, ki, k64.ndim), b64


def along(vec, axis: int, ndim: int) -> np.ndarray:
    vec = np.asarray(vec)
    if vec.ndim == 0:
        return vec
    shape = [1] * ndim
    shape[axis] = vec.shape[0]
    return vec.reshape(shape)


def exact_f64(k: np.ndarray) -> np.ndarray:
    """``k`` for float64 arithmetic: float32/float64 as they are (NumPy promotes them exactly
    in a product with float64 — no separate conversion pass), other dtypes converted."""
    return k if k.dtype in (np.float32, np.float64) else k.astype(np.float64)
