"""The s/t algebra, shared by both IR paths.

A chain of per-channel affine ops after a root collapses into one ``y·s + t``
(:func:`collapse`), and an affine in front of a root into the kernel and a bias
(:func:`group_matrix_np` / :func:`place_np` place a per-input-channel vector on the kernel's
axes, for any feature grouping). The arithmetic is a parameter: NumPy float64 on the host
(:class:`np64`, for values known at transform time), ``lax`` in a trace (:func:`lax_arith`),
or StableHLO ops (``hlofold._fold.stablehlo.fold``). The dtype policy: known values are computed in
float64 and rounded once to the kernel's dtype (``_fold.core.rules.round_kernel``); in the graph the
arithmetic runs in float32, or float64 when the program computes in float64.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .chain_rules import Block, on_axis


class np64:
    """Arithmetic on the host in float64 (all operands known at transform time)."""

    @staticmethod
    def asarray(x):
        return np.asarray(x, np.float64)

    add, sub, mul, div = (np.add, np.subtract, np.multiply, np.divide)
    neg = staticmethod(np.negative)


def kinds(steps) -> list[str]:
    return [st.kind for st in steps]


# step kinds that add to ``t`` (a StableHLO ``batch_norm_inference`` step, "bn", both adds
# and scales: it is sub μ, mul γ/√(σ²+ε), add β) and those that leave ``s`` as it is
_SHIFTS = frozenset({"add", "sub", "rsub", "bn"})
_NO_SCALE = frozenset({"add", "sub"})


def has_shift(steps) -> bool:
    """Whether absorbed ``steps`` add to ``t`` (so a bias remains after the fold)."""
    return any(st.kind in _SHIFTS for st in steps)


def has_scale(steps) -> bool:
    """Whether absorbed ``steps`` change ``s`` (so the kernel is rescaled)."""
    return any(st.kind not in _NO_SCALE for st in steps)


def collapse(kinds: Sequence[str], vals: list, channels: int, xp=np64):
    """Collapse absorbed ops (``kinds``: add/sub/rsub/mul/div/neg, with operand ``vals``)
    into (s, t): vectors of length ``channels`` or scalars. ``xp`` is the arithmetic: NumPy
    float64 on the host, ``lax`` in a trace, or StableHLO ops (``hlofold._fold.stablehlo.fold``).

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
    ``channels`` (a read-only view where a vector is broadcast)."""
    x = np.asarray(x, np.float64)
    if x.shape == (channels,):
        return x
    if x.ndim == 0:             # (a new vector: a tenth of broadcast_to's cost)
        return np.full(channels, x)
    return np.broadcast_to(x, (channels,))


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


def input_scale(s_in, ko: int, ki: int, groups: int, out_channels: int, ndim: int):
    """A per-input-channel scale ``s_in`` placed on a kernel with output axis ``ko`` and
    input axis ``ki`` (``ndim`` axes): what ``K ⊙_in s_in`` multiplies ``K`` by, as an array
    broadcasting against it. One group (a dense layer, a plain conv): a vector along ``ki``;
    one input channel per group (depthwise): a vector along ``ko``; else the (O, I/G) matrix
    of each output channel's group (a grouped conv: the kernel's size over its window)."""
    s_in = np.asarray(s_in, np.float64)
    if s_in.ndim == 0:
        return s_in
    ipg = s_in.shape[0] // groups
    if groups == 1:
        return along(s_in, ki, ndim)
    if ipg == 1:
        return along(np.repeat(s_in, out_channels // groups), ko, ndim)
    return place_np(group_matrix_np(s_in, out_channels, groups), ko, ki, ndim)


def forward_kernel(k, s_in, t_in, ko: int, ki: int, groups: int, out_channels: int,
                   bias_map=None):
    """An affine ``x·s_in + t_in`` in front of a root, folded on the host: ``(factor, b)``
    with ``factor`` what the kernel is multiplied by (:func:`input_scale`; the caller rounds
    ``K·factor·s`` once, ``_fold.core.rules.round_kernel``) and ``b`` the bias the shift adds,
    ``Σ K·t_in`` per output channel in float64, or ``bias_map(taps)`` (a padded convolution:
    ``taps`` is the kernel with the input features contracted against ``t_in``, that axis
    kept with size 1). ``k`` in any float dtype: read in blocks, no kernel-sized float64
    temporary."""
    factor = input_scale(s_in, ko, ki, groups, out_channels, np.ndim(k))
    if not np.any(t_in):
        b = None
    else:
        t = input_scale(t_in, ko, ki, groups, out_channels, np.ndim(k))
        taps = blockwise_sum(k, t, ki)                       # (kernel layout, ki of size 1)
        b = (np.sum(taps, axis=tuple(a for a in range(np.ndim(k)) if not on_axis(a, ko)))
             .reshape(-1) if bias_map is None else bias_map(taps))
    return factor, b


def blockwise_sum(k, factor, axis: int, chunk: int = 1 << 16) -> np.ndarray:
    """``Σ_axis K·factor`` in float64 (``axis`` kept with size 1), reading ``K`` in blocks
    along its leading axis: no kernel-sized float64 temporary."""
    k = np.asarray(k)
    out_shape = list(k.shape)
    out_shape[axis] = 1
    if k.ndim == 0 or k.size == 0:
        return np.zeros(out_shape)
    rows = max(1, chunk // max(1, k[0].size))
    f = np.asarray(factor, np.float64)
    parts = []
    for i in range(0, k.shape[0], rows):
        fb = f if f.ndim == 0 or f.shape[0] == 1 else f[i:i + rows]
        parts.append(np.sum(np.multiply(k[i:i + rows], fb, dtype=np.float64), axis=axis,
                            keepdims=True))
    return np.concatenate(parts, axis=0) if axis != 0 else np.sum(parts, axis=0)


def along(vec, axis, ndim: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast along ``axis`` (an int, or a
    ``chain_rules.Block``: the vector's row-major reshape over the block's axes)."""
    vec = np.asarray(vec)
    if vec.ndim == 0:
        return vec
    shape = [1] * ndim
    if isinstance(axis, Block):
        for a, d in zip(axis.axes, axis.dims):
            shape[a] = d
    else:
        shape[axis] = vec.shape[0]
    return vec.reshape(shape)
