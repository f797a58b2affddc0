"""Parallel branches summed: one convolution plus a bias (structural re-parameterization).

A RepVGG, MobileOne, ACNet or DBB block is trained as a sum of linear branches that read one
input ``x``: convolutions of several window sizes, each with its BatchNorm, an identity (a
BatchNorm of ``x``), an average pool, a 1×1 convolution followed by a k×k one. At inference
the sum is one convolution:

    Σᵢ (convᵢ(x, Kᵢ)·sᵢ + tᵢ)  ==  conv(x, Σᵢ embed(Kᵢ·sᵢ)) + Σᵢ tᵢ

when every branch reads ``x`` at the same input positions as a tap of the merged window
(:func:`offsets`: same stride; a window that sits inside the largest one at an integer
offset, same dilation for windows wider than one tap; no input dilation; a grouping the
merged convolution can hold). This module is that rule for both IR adapters: each reads its
IR into :class:`Term` s (a kernel in the canonical ``(O, I/G, *window)`` layout, the affine
after it), and the core decides (:func:`plan`), builds the merged kernel and bias
(:func:`merged_kernel`, :func:`merged_shift`) and describes the merge for the report. A
per-channel affine after the whole sum (a BatchNorm of the block's output) joins every
member (:func:`then_affine`) when the sum is the merged branches and known biases alone.

Every branch kind is a convolution here: the identity is a depthwise 1×1 kernel of ones, an
average pool a depthwise window of ones (its ``1/n`` is a scale after it), a 1×1 → k×k pair
the composed kernel (:func:`compose`; the first one's bias, seen through the second one's
zero padding, becomes a per-position bias map). The arithmetic is a parameter (``xp``: NumPy
in float64 on the host, ``jax.numpy`` in a trace).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from hlofold._base.chain_rules import Refusal
from .patterns import border_masks
from hlofold._base.reasons import Reason


@dataclasses.dataclass(frozen=True)
class Window:
    """Where a convolution reads its input, per spatial dimension in the input's order."""

    size: tuple            # taps
    strides: tuple
    padding: tuple         # (lo, hi) pairs
    rhs_dilation: tuple
    lhs_dilation: tuple
    groups: int
    in_channels: int
    out_channels: int
    batch_groups: int = 1

    @property
    def extent(self) -> int:
        return math.prod(r * (k - 1) + 1 for k, r in zip(self.size, self.rhs_dilation))

    def describe(self) -> str:
        return "×".join(str(k) for k in self.size)


def depthwise_window(channels: int, size: Sequence[int], strides: Sequence[int],
                     padding: Sequence, dilation: Sequence[int] | None = None) -> Window:
    """The window of an identity (1×1, stride 1) or an average pool, as a depthwise conv."""
    n = len(size)
    return Window(tuple(size), tuple(strides), tuple(tuple(p) for p in padding),
                  tuple(dilation or (1,) * n), (1,) * n, channels, channels, channels)


@dataclasses.dataclass
class Term:
    """One branch: ``conv(x, kernel)·scale + shift`` (``kernel`` canonical ``(O, I/G,
    *window)``; ``scale``/``shift`` per output channel, None for 1/0; ``shift_map`` a
    per-position bias ``(O, *out spatial)``, from a composed pair)."""

    kind: str              # "conv", "identity", "pool", "pair"
    window: Window
    kernel: Any
    scale: Any = None
    shift: Any = None
    shift_map: Any = None
    handle: Any = None     # the adapter's convolution op a merged one can be written as
    label: str = ""        # how the report names it, where the kind does not say

    def describe(self) -> str:
        if self.label:
            return self.label
        w = self.window.describe()
        return {"conv": f"{w} conv" + (f" g{self.window.groups}"
                                       if self.window.groups != 1 else ""),
                "identity": "identity", "pool": f"{w} avg pool"}[self.kind]


@dataclasses.dataclass
class Leaf:
    """A term of a sum as an adapter read it: ``kind`` conv/pool/identity (or, after
    :func:`group_leaves`, pair/shared/nonlinear; "guarded": a folded site's run-time guard)
    on input ``x``; ``leaf`` the sum's operand; ``base`` its conv/pool op; ``chain`` the
    affine ops after it, ``(op, operand position)`` outermost first; ``first`` a 1×1 conv
    in front of the base (a pair); ``alt`` another reading of an identity leaf: ``(x', op)``,
    a nonlinearity on a branch of ``x'``."""

    kind: str
    x: Any
    leaf: Any
    base: Any = None
    chain: list = dataclasses.field(default_factory=list)
    first: "Leaf | None" = None
    steps: list = dataclasses.field(default_factory=list)     # the adapter's, base outwards
    alt: tuple | None = None


def group_leaves(leaves: Sequence["Leaf | None"], single) -> list[list[int]]:
    """The candidate merges of one sum: indices of ``leaves`` (None: not a branch) reading
    one input, with a convolution among them. On the way: a conv/pool whose value has other
    readers (``single(leaf)`` false) becomes "shared"; a 1×1 → k×k pair is read as one
    branch where its input is another branch's; a term that is another branch's input
    itself, where that input is a layer's output (``x + branches(x)``, ``x = bn(conv(x'))``),
    is read as the identity, not as a branch of ``x'``; an identity on its own becomes
    "nonlinear" where its other reading lands on another branch's input."""
    for lf in leaves:
        if lf is not None and lf.kind in ("conv", "pool") and not single(lf.leaf):
            lf.kind, lf.first = "shared", None
    for lf in leaves:      # x itself, where x is a layer's output (RepViT's first block: the
        if lf is None or lf.leaf == lf.x:            # stem's conv + BN, then x + branches(x))
            continue
        others = [o for o in leaves if o is not None and o is not lf]
        if any(o.x == lf.leaf and o.kind != "identity" for o in others) and \
                not any(o.x == lf.x for o in others):
            lf.kind, lf.x, lf.base, lf.chain, lf.first, lf.alt = \
                "identity", lf.leaf, None, [], None, None
    plain = [lf.x for lf in leaves if lf is not None and lf.first is None]
    for lf in leaves:
        if lf is not None and lf.first is not None and any(lf.first.x == x for x in plain):
            lf.x, lf.kind = lf.first.x, "pair"
    groups: list[list[int]] = []
    for k, lf in enumerate(leaves):
        if lf is not None:
            g = next((g for g in groups if leaves[g[0]].x == lf.x), None)
            groups.append([k]) if g is None else g.append(k)
    for k, lf in enumerate(leaves):
        if lf is None or lf.alt is None:
            continue
        mine = next(g for g in groups if k in g)
        other = next((g for g in groups if leaves[g[0]].x == lf.alt[0]), None)
        if len(mine) == 1 and other is not None:
            groups.remove(mine)
            lf.kind, lf.x, lf.base = "nonlinear", *lf.alt
            other.append(k)
    return [g for g in groups if len(g) >= 2 and
            any(leaves[k].kind in ("conv", "pair", "guarded") for k in g)]


# branches read as such that do not merge (both adapters; "guarded" is each adapter's own)
NOT_MERGED = {
    "shared": Reason("branches", "a branch's value is read elsewhere too (merged, its "
                     "convolution would run twice)"),
    "nonlinear": Reason("branches", "a nonlinearity on a branch"),
}


def leaf_label(kind: str) -> str:
    """How a branch that is no term is named in a merge's note."""
    return {"pair": "1×1→k×k pair", "shared": "a branch read elsewhere",
            "nonlinear": "a nonlinear branch", "guarded": "a guarded branch"}.get(
                kind, f"{kind} branch")


def pool_window(dims, strides, padding, base_dilation, window_dilation, lhs_spec,
                channels: int) -> Window | None:
    """The window of an average pool's ``reduce_window`` (per input axis; ``lhs_spec``:
    the input's batch, feature and spatial axes), None where it pools over the batch or
    the features or dilates its input."""
    nb, nf = lhs_spec[0], lhs_spec[1]
    if any(d != 1 for d in base_dilation) or (dims[nb], dims[nf], strides[nb],
                                               strides[nf]) != (1, 1, 1, 1) or \
            tuple(padding[nb]) != (0, 0) or tuple(padding[nf]) != (0, 0):
        return None
    sp = lhs_spec[2:]
    return depthwise_window(channels, [dims[d] for d in sp], [strides[d] for d in sp],
                            [tuple(padding[d]) for d in sp],
                            [window_dilation[d] for d in sp])


def pair_structure(first: Window, second: Window, handle, conv: bool) -> "Term | Reason":
    """The term (no values yet) of a 1×1 convolution followed by ``second`` (a conv when
    ``conv``, else a pool): the second's taps over the first's input channels."""
    if any(k != 1 for k in first.size + first.strides + first.lhs_dilation) or \
            any(q != (0, 0) for q in first.padding):
        return _reason("the first convolution of a sequential pair is not 1×1 (stride 1, "
                       "no padding)")
    return Term("pair", dataclasses.replace(second, groups=math.gcd(first.groups,
                                                                    second.groups),
                                            in_channels=first.in_channels),
                None, handle=handle if conv else None, label=_pair_label(second, conv))


def _pair_label(second: Window, conv: bool) -> str:
    return f"1×1→{second.describe()} " + ("conv" if conv else "avg pool")


def identity_kernel(channels: int, ndim: int) -> np.ndarray:
    return np.ones((channels, 1) + (1,) * ndim)


def _reason(text: str) -> Reason:
    return Reason("branches", text)


def offsets(target: Window, w: Window) -> tuple | Reason:
    """Where window ``w`` sits in ``target`` (per dimension, the first tap's index), or why
    it does not."""
    if any(d != 1 for d in w.lhs_dilation + target.lhs_dilation):
        return _reason("an input-dilated (transposed) convolution reads no taps of the other")
    if w.batch_groups != 1 or target.batch_groups != 1:
        return _reason("a batch-grouped convolution")
    if (w.in_channels, w.out_channels) != (target.in_channels, target.out_channels):
        return _reason(f"channels differ ({w.in_channels}->{w.out_channels} vs "
                       f"{target.in_channels}->{target.out_channels})")
    if w.groups % target.groups:
        return _reason(f"groups differ ({w.groups} vs {target.groups}: the merged kernel "
                       "cannot hold it)")
    out = []
    for d, (k, st, (lo, _), rd, K, ST, (LO, _), RD) in enumerate(zip(
            w.size, w.strides, w.padding, w.rhs_dilation, target.size, target.strides,
            target.padding, target.rhs_dilation)):
        if st != ST:
            return _reason(f"strides differ ({tuple(w.strides)} vs {tuple(target.strides)})")
        if k > 1 and rd != RD:
            return _reason(f"dilations differ ({tuple(w.rhs_dilation)} vs "
                           f"{tuple(target.rhs_dilation)})")
        if (LO - lo) % RD or not 0 <= (LO - lo) // RD <= K - k:
            return _reason(f"windows do not align ({w.describe()} with padding "
                           f"{tuple(p[0] for p in w.padding)} inside {target.describe()} "
                           f"with padding {tuple(p[0] for p in target.padding)})")
        out.append((LO - lo) // RD)
    return tuple(out)


@dataclasses.dataclass
class Plan:
    """A merge: the target (whose convolution op the merged one is written as), the members
    with their offsets in it, and the terms left out with why."""

    target: int
    members: dict           # term index -> offsets
    left: dict              # term index -> Reason


def plan(terms: Sequence[Term]) -> Plan | Reason:
    """Which of ``terms`` (all reading one input, summed) merge into one convolution."""
    convs = [i for i, t in enumerate(terms) if t.handle is not None]
    if not convs:
        return _reason("no branch is a convolution the merged one can be written as")
    target = max(convs, key=lambda i: (terms[i].window.extent, -terms[i].window.groups))
    tw = terms[target].window
    members, left = {}, {}
    for i, t in enumerate(terms):
        off = offsets(tw, t.window)
        if isinstance(off, Reason):
            left[i] = off
        else:
            members[i] = off
    if len(members) < 2:
        return next(iter(left.values()))
    return Plan(target, members, left)


def expand_groups(k, groups: int, to: int, xp=np):
    """Kernel ``k`` ``(O, I/groups, …)`` written for ``to`` groups (``groups % to == 0``):
    its blocks placed on the wider input axis, zeros elsewhere."""
    if groups == to:
        return k
    o, ipg = k.shape[0], k.shape[1]
    opg_from, ipg_to = o // groups, ipg * groups // to
    oo = np.arange(o)
    col = (oo // opg_from)[:, None] * ipg + np.arange(ipg)[None, :] \
        - (oo // (o // to))[:, None] * ipg_to                    # (O, I/groups)
    place = np.zeros((o, ipg, ipg_to))
    place[oo[:, None], np.arange(ipg)[None, :], col] = 1.0
    return xp.einsum("oi...,oij->oj...", k, xp.asarray(place, dtype=k.dtype))


def scaled_kernel(t: Term, xp=np):
    """``K·s`` of a term (its scale along the output axis)."""
    if t.scale is None:
        return t.kernel
    s = xp.asarray(t.scale)
    return t.kernel * (s.reshape((-1,) + (1,) * (t.kernel.ndim - 1)) if s.ndim else s)


def merged_kernel(terms: Sequence[Term], p: Plan, xp=np):
    """``Σ embed(Kᵢ·sᵢ)`` of the members, canonical ``(O, I/G, *target window)``."""
    tw = terms[p.target].window
    total = None
    for i, off in p.members.items():
        t = terms[i]
        k = expand_groups(scaled_kernel(t, xp), t.window.groups, tw.groups, xp)
        pads = [(0, 0), (0, 0)] + [(o, K - s - o) for o, s, K in zip(off, t.window.size,
                                                                        tw.size)]
        if any(p_ != (0, 0) for p_ in pads):
            k = xp.pad(k, pads)
        total = k if total is None else total + k
    return total


def merged_shift(terms: Sequence[Term], p: Plan, xp=np) -> tuple[Any, Any]:
    """``(Σ tᵢ, Σ maps)`` of the members (None where there is none)."""
    vec, maps = None, None
    for i in p.members:
        t = terms[i]
        if t.shift is not None:
            vec = t.shift if vec is None else vec + t.shift
        if t.shift_map is not None:
            maps = t.shift_map if maps is None else maps + t.shift_map
    return vec, maps


def then_affine(t: Term, scale, xp=np) -> Term:
    """Term ``t`` followed by ``·scale`` per output channel (the sum's own affine, e.g. a
    BatchNorm of the block's output, spread over its members): its scale, shift and
    shift map times ``scale``. The affine's shift is added once, by the caller."""
    if scale is None:
        return t
    s = xp.asarray(scale)
    col = lambda a: s.reshape((-1,) + (1,) * (xp.ndim(a) - 1)) if s.ndim else s
    return dataclasses.replace(
        t, scale=s if t.scale is None else t.scale * s,
        shift=None if t.shift is None else t.shift * s,
        shift_map=None if t.shift_map is None else t.shift_map * col(t.shift_map))


def compose(first: Term, second: Term, in_spatial: Sequence[int],
            out_spatial: Sequence[int], xp=np) -> Term | Reason:
    """A 1×1 convolution (with its affine) followed by ``second`` (a convolution or a pool,
    with its affine) as one term. The first one's shift, seen through the second one's
    padding, is a per-position bias where the border reads zeros."""
    f, w = first.window, second.window
    structure = pair_structure(f, w, second.handle, second.kind == "conv")
    if isinstance(structure, Reason):
        return structure
    if any(d != 1 for d in w.lhs_dilation):
        return _reason("an input-dilated (transposed) convolution")
    wide = (lambda a: np.asarray(a, np.float64)) if xp is np else (lambda a: a)
    g = math.gcd(f.groups, w.groups)
    k2s = wide(scaled_kernel(second, xp))
    k1 = expand_groups(wide(scaled_kernel(first, xp)), f.groups, g, xp)
    k2 = expand_groups(k2s, w.groups, g, xp)
    o, m, c = k2.shape[0], k1.shape[0], f.in_channels
    k1g = k1.reshape((g, m // g, c // g))                      # 1×1: spatial dims dropped
    k2g = k2.reshape((g, o // g, m // g) + tuple(k2.shape[2:]))
    kernel = xp.einsum("gom...,gmi->goi...", k2g, k1g).reshape(
        (o, c // g) + tuple(k2.shape[2:]))
    shift_map, shift = None, second.shift
    if first.shift is not None:
        # the second kernel (with its scale) against the constant image b1: (O, *window)
        b1 = xp.broadcast_to(xp.asarray(first.shift), (m,)).reshape(w.groups, m // w.groups)
        taps = xp.einsum("om...,om->o...", k2s, xp.repeat(b1, o // w.groups, axis=0))
        masks = border_masks(in_spatial, w.size, out_spatial, w.strides,
                             [p[0] for p in w.padding], w.lhs_dilation, w.rhs_dilation)
        if isinstance(masks, Refusal):
            return _reason(str(masks.reason))
        if masks is None:
            b = taps.reshape(o, -1).sum(axis=1)
            shift = b if shift is None else shift + b
        else:                                                   # (O, *out spatial)
            n = len(masks)
            letters = "abcdefgh"[:n]
            spec = ("o" + letters + "," + ",".join(f"{q}{q.upper()}" for q in letters)
                    + "->o" + letters.upper())
            shift_map = xp.einsum(spec, taps, *[xp.asarray(mk, dtype=taps.dtype)
                                                for mk in masks])
    return dataclasses.replace(structure, kernel=kernel, shift=shift, shift_map=shift_map)


def describe(terms: Sequence[Term], p: Plan, others=()) -> tuple[list[str], str]:
    """``(members, note)`` for the report: what merged, into what, and what was left
    (``others``: ``(label, reason)`` of branches that are no term, e.g. a nonlinear one)."""
    tw = terms[p.target].window
    note = (f"{len(p.members)} branches -> one {tw.describe()} conv"
            + (f" (stride {tuple(tw.strides)})" if any(s != 1 for s in tw.strides) else "")
            + (f" g{tw.groups}" if tw.groups != 1 else ""))
    for i, why in p.left.items():
        note += f"; {terms[i].describe()} left: {why}"
    for label, why in others:
        note += f"; {label} left: {why}"
    return [terms[i].describe() for i in p.members], note
