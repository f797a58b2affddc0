"""Pairs for cross-layer equalization (:mod:`hlofold._core.equalize`) read from a jaxpr.

A pair starts at a convolution or dot whose kernel is a parameter leaf and follows its output
channel, equation by equation, to the next convolution or dot whose activations it is and
whose kernel is a leaf too. Each equation on the way must commute with a positive
per-channel scale: :data:`RULES` has one entry per primitive (how the channel axis moves
through it, or why the pair stops there). Every value on the path is read once (a residual
add, a second reader, would see the scaled channels), and the two kernels and every bias
scaled with them are leaves read nowhere else.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import _compat as C
from .._core.chain_rules import Refusal
from .._core.equalize import Pair, Second
from .patterns import PATTERNS

_CALLS = C.JIT_NAMES | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
_PASS = {"convert_element_type", "copy", "copy_p", "neg", "reduce_precision"}
SHAPES = {"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "expand_dims"}
NOT_HOMOGENEOUS = {"tanh", "logistic", "exp", "log", "erf", "integer_pow", "pow", "sqrt",
                   "rsqrt", "abs", "sign", "sin", "cos", "log1p", "expm1", "clamp", "min",
                   "erf_inv", "cbrt", "square"}


@dataclasses.dataclass
class Refused:
    """A first layer whose pair was not formed: its kernel leaf, where, and why."""

    kernel: int
    eqn: object
    reason: str


@dataclasses.dataclass
class _Ctx:
    jaxpr: object
    uses: dict
    producer: dict
    leaves: dict                      # top-level leaf var -> index (empty in a body)
    biases: list
    literals: dict = dataclasses.field(default_factory=dict)   # a body's var -> value


def index_uses(jaxpr):
    uses, producer = {}, {}
    for i, e in enumerate(jaxpr.eqns):
        for k, v in enumerate(e.invars):
            if isinstance(v, C.Var):
                uses.setdefault(v, []).append((e, k))
        for v in e.outvars:
            producer[v] = e
    for v in jaxpr.outvars:
        if isinstance(v, C.Var):
            uses.setdefault(v, []).append((None, -1))
    return uses, producer


@dataclasses.dataclass
class Found:
    """A pair, the equation it starts at, and the value its second layers read (its channel
    axis): what calibration measures for smoothing."""

    pair: Pair
    eqn: object
    end: object
    end_axis: int


def find_pairs(jaxpr, n_leaves: int, norms: bool = False
               ) -> tuple[list[Found], list[Refused]]:
    """Every pair of the top level of ``jaxpr`` whose inputs begin with ``n_leaves``
    parameter leaves (keys of the pairs: leaf indices), starting at a layer (a convolution
    or dot whose kernel is a leaf) — and with ``norms``, at a norm's scale too (a leaf
    vector multiplied into the activations: γ); and the starts refused. Second layers
    claimed by an earlier pair are not paired again."""
    uses, producer = index_uses(jaxpr)
    leaves = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    found, refused, claimed = [], [], set()
    for e in jaxpr.eqns:
        ctx = _Ctx(jaxpr, uses, producer, leaves, [])
        start = _layer_start(ctx, e) or (_norm_start(ctx, e) if norms else None)
        if start is None:
            continue
        if isinstance(start[0], str):
            refused.append(Refused(start[1], e, start[0]))
            continue
        k1, axis, out_axis = start
        got = _follow(ctx, e.outvars[0], axis)
        if isinstance(got, str):
            refused.append(Refused(leaves[k1], e, got))
            continue
        seconds, end, end_axis = got
        if any(sec.key in claimed for sec in seconds):
            continue
        claimed.update(sec.key for sec in seconds)
        found.append(Found(Pair(str(leaves[k1]), out_axis, seconds,
                                [(str(i), ax) for i, ax in ctx.biases]), e, end, end_axis))
    return found, refused


def _layer_start(ctx, e):
    """``(kernel var, output channel axis, kernel output axis)`` of a layer whose kernel is a
    leaf; ``(why, leaf index)`` for a shared one; None for anything else."""
    pat = PATTERNS.get(e.primitive.name)
    if pat is None:
        return None
    info = pat.inspect_root(e)
    if isinstance(info, Refusal):
        return None
    k1 = e.invars[info.kernel_index]
    if k1 not in ctx.leaves:       # (the weight on the lhs: Equinox's W @ x)
        info = next((a for a in pat.alternatives(e) if e.invars[a.kernel_index] in ctx.leaves),
                    None)
        if info is None:
            return None
        k1 = e.invars[info.kernel_index]
    if not isinstance(info.kernel_axis, int):
        return ("a multi-head kernel (its output channels over several axes) is not paired "
                "as a first layer", ctx.leaves[k1])
    why = _single_leaf(ctx, k1, "its kernel")
    return (why, ctx.leaves[k1]) if why else (k1, info.channel_axis, info.kernel_axis)


def _norm_start(ctx, e):
    """A norm's scale: ``x·γ`` with γ a leaf vector (through reshapes and broadcasts) whose
    one axis is the product's channel axis."""
    if e.primitive.name != "mul":
        return None
    out = e.outvars[0].aval.shape
    for k, g in enumerate(e.invars):
        shape = getattr(getattr(g, "aval", None), "shape", ())
        axis = varying_axis(ctx.producer, g, len(out)) if len(shape) == len(out) else None
        if axis is None or axis < 0 or shape[axis] != out[axis] or \
                not isinstance(e.invars[1 - k], C.Var):
            continue
        while g not in ctx.leaves:
            p = ctx.producer.get(g)
            if p is None or p.primitive.name not in SHAPES or len(ctx.uses.get(g, [])) != 1:
                break
            g = p.invars[0]
        gdims = [d for d, n in enumerate(getattr(g, "aval", None).shape) if n != 1] \
            if g in ctx.leaves else []
        if g in ctx.leaves and len(gdims) == 1 and g.aval.shape[gdims[0]] == out[axis]:
            why = _single_leaf(ctx, g, "the norm's scale")
            return (why, ctx.leaves[g]) if why else (g, axis, gdims[0])
    return None


def varying_axis(producer, v, rank: int):
    """The one axis along which ``v`` (of rank ``rank``) varies, where it is a broadcast
    of values with one non-unit axis (``jnp`` broadcasting a bias or a norm's scale to the
    activations' shape); -1 where it varies along none; None otherwise."""
    mapping = list(range(rank))            # v's axes -> the first value's
    for _ in range(8):
        shape = v.aval.shape
        dims = [d for d, n in enumerate(shape) if n != 1]
        if len(dims) <= 1:
            return (mapping[dims[0]] if mapping[dims[0]] is not None else None) \
                if dims else -1
        p = producer.get(v)
        if p is None or p.primitive.name != "broadcast_in_dim":
            return None
        src, bd = p.invars[0], p.params["broadcast_dimensions"]
        if not isinstance(src, C.Var):
            return None
        mapping = [mapping[bd[i]] if src.aval.shape[i] == shape[bd[i]] else None
                   for i in range(src.aval.ndim)]
        v = src
    return None


def _single_leaf(ctx, v, what: str):
    if len(ctx.uses.get(v, [])) != 1:
        return f"{what} is read {len(ctx.uses.get(v, []))} times (a shared weight)"
    return None


def _follow(ctx, v, axis: int):
    """From the first layer's output ``v`` (channel ``axis``) to the layers that read it:
    ``([Second], the value they read, its channel axis)``, or why not."""
    for _ in range(10_000):
        u = ctx.uses.get(v, [])
        if any(e is None for e, _ in u):
            return "its output is a program output before another layer reads it"
        if len(u) == 3 and (leaky := _leaky(ctx, u)) is not None:
            v = leaky                               # (the channel axis stays)
            continue
        if len(u) > 1:
            seconds = [_second(ctx, e, pos, axis) for e, pos in u]
            if all(not isinstance(x, str) for x in seconds):
                return seconds, v, axis           # (q, k and v; gate and up)
            return (f"its output is read {len(u)} times, not only by layers (a residual or "
                    f"another reader would see the scaled channels)")
        if not u:
            return "its output is not read"
        e, pos = u[0]
        name = e.primitive.name
        if name in PATTERNS:
            got = _second(ctx, e, pos, axis)
            if not isinstance(got, str):
                return [got], v, axis
            through = _through_dot(ctx, e, pos, axis)
            if through is None:
                return got
            v, axis = e.outvars[0], through
            continue
        rule = RULES.get(name)
        if rule is None and name in _CALLS:
            rule = _call
        if rule is None:
            why = "is not positively homogeneous" if name in NOT_HOMOGENEOUS else \
                "is not one equalization passes through"
            return f"{name} on the way {why}"
        got = rule(ctx, e, pos, axis)
        if isinstance(got, str):
            return got
        v, axis = e.outvars[0], got
    return "the path is too long"


def _leaky(ctx, u):
    """LeakyReLU / PReLU, ``where(x >= 0, x, a·x)``: the comparison with 0, the product by
    a slope (one or one per channel), the select; its output, or None. Positive scales keep
    the sign, and the product commutes with them."""
    by = {e.primitive.name: (e, pos) for e, pos in u}
    cmp, mul, sel = by.get("ge") or by.get("gt"), by.get("mul"), by.get("select_n")
    if cmp is None or mul is None or sel is None or cmp[1] != 0 or \
            not _is_zero(ctx, cmp[0].invars[1]):
        return None
    c, m, s = cmp[0].outvars[0], mul[0].outvars[0], sel[0]
    if s.invars[0] is not c or len(s.invars) != 3 or s.invars[1] is not m or sel[1] != 2 or \
            len(ctx.uses.get(c, [])) != 1 or len(ctx.uses.get(m, [])) != 1:
        return None
    return s.outvars[0]


def _through_dot(ctx, e, pos, axis):
    """A dot of two activations that contracts none of the channel axes (attention's
    ``probs @ v``, heads a batch axis): linear in each channel, which moves to its output
    position; else None."""
    if e.primitive.name != "dot_general" or e.invars[1 - pos] in ctx.leaves:
        return None
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    contract, batch = (lc, lb) if pos == 0 else (rc, rb)
    if any(a in contract for a in _each(axis)):
        return None
    nd = [len(x.aval.shape) for x in e.invars]
    free = [d for d in range(nd[pos]) if d not in contract and d not in batch]
    n_lhs_free = nd[0] - len(lc) - len(lb)
    # output: the batch axes (a head axis among them), the lhs's free axes, the rhs's
    return _one(tuple(list(batch).index(a) if a in batch else
                      len(lb) + (0 if pos == 0 else n_lhs_free) + free.index(a)
                      for a in _each(axis)))


def _second(ctx, e, pos, axis):
    pat = PATTERNS.get(e.primitive.name)
    if pat is None:
        return f"{e.primitive.name} reads it besides the layers"
    if isinstance(axis, tuple):
        return f"the next {e.primitive.name} reads the channels split over axes"
    ch = pat.input_channel(e, pos)
    if isinstance(ch, Refusal):
        return f"the next {e.primitive.name}: {ch.reason}"
    act_axis, in_axis = ch
    if act_axis != axis:
        return f"the next {e.primitive.name} does not contract the channel axis"
    info = pat.inspect_root(e)
    if getattr(info, "kernel_index", None) != 1 - pos:     # (the weight on the lhs: W @ x)
        info = next((a for a in pat.alternatives(e) if a.kernel_index == 1 - pos), info)
    k2 = e.invars[1 - pos]
    if isinstance(info, Refusal) or k2 not in ctx.leaves or \
            getattr(info, "kernel_index", None) != 1 - pos:
        return f"the next {e.primitive.name}'s kernel is not a parameter leaf as it is"
    why = _single_leaf(ctx, k2, "the next layer's kernel")
    if why:
        return why
    # (a multi-head kernel, (d, heads, head_dim): its input rows are what is scaled; any of
    # its output axes serves to read them)
    out = info.kernel_axis if isinstance(info.kernel_axis, int) else info.kernel_axis.axes[0]
    return Second(str(ctx.leaves[k2]), in_axis, out, int(e.params.get("feature_group_count", 1)))


# ------------------------------------------------------------------ per-primitive rules

def _other(e, pos):
    return e.invars[1 - pos]


def _is_zero(ctx, x) -> bool:
    """A literal zero (through casts and broadcasts; a call's body sees its operands)."""
    for _ in range(8):
        if isinstance(x, C.Literal):
            return bool(np.all(np.asarray(x.val) == 0))
        if x in ctx.literals:
            return bool(np.all(np.asarray(ctx.literals[x]) == 0))
        p = ctx.producer.get(x)
        if p is None or p.primitive.name not in ("convert_element_type", "broadcast_in_dim"):
            return False
        x = p.invars[0]
    return False


def _bias(ctx, e, pos, axis):
    """x ± b, b one value per channel: b is divided by the scale too — the leaves it is
    linear in (:func:`_additive`), or nothing for a literal zero."""
    if e.primitive.name == "sub" and pos == 1:
        return "a subtraction from the channels"
    b = _other(e, pos)
    if _is_zero(ctx, b):
        return axis
    if isinstance(axis, tuple):
        return f"{e.primitive.name} of a value while the channels are split over axes"
    out = e.outvars[0].aval.shape
    shape = getattr(getattr(b, "aval", None), "shape", None)
    if shape is None or len(shape) != len(out) or shape[axis] != out[axis] or \
            varying_axis(ctx.producer, b, len(out)) != axis:
        return (f"{e.primitive.name} of a value that is not one per channel (a residual "
                f"add ties channels)")
    found = _additive(ctx, b, out[axis], 0)
    if isinstance(found, str):
        return f"{e.primitive.name} of {found}"
    for leaf, dim in found:
        ctx.biases.append((ctx.leaves[leaf], dim))
    return axis


def _additive(ctx, v, channels: int, depth: int):
    """The leaves a per-channel value is linear in (each scaled with the channels makes it
    scaled: ``β − μ·γ/√(σ²+ε)`` through ``β`` and ``μ``): ``[(leaf, its channel axis)]``, or
    what it is instead. Every value on the way is read once, each leaf nowhere else."""
    if _is_zero(ctx, v):
        return []
    if v in ctx.leaves:
        why = _single_leaf(ctx, v, "a bias on the way")
        dims = [d for d, n in enumerate(v.aval.shape) if n != 1]
        if why or len(dims) != 1 or v.aval.shape[dims[0]] != channels:
            return why or "a bias leaf that is not one value per channel"
        return [(v, dims[0])]
    p = ctx.producer.get(v)
    if p is None or depth > 16 or len(ctx.uses.get(v, [])) != 1:
        return "a per-channel value that is not computed from parameter leaves alone"
    name = p.primitive.name
    if name in SHAPES or name == "neg":
        return _additive(ctx, p.invars[0], channels, depth + 1)
    if name in ("add", "sub"):
        a = _additive(ctx, p.invars[0], channels, depth + 1)
        b = _additive(ctx, p.invars[1], channels, depth + 1)
        return a if isinstance(a, str) else b if isinstance(b, str) else a + b
    if name in ("mul", "div"):        # (a linear term times a factor left as it is)
        for k in ((0, 1) if name == "mul" else (0,)):
            got = _additive(ctx, p.invars[k], channels, depth + 1)
            if not isinstance(got, str):
                return got
    return f"a per-channel value computed by {name} (not linear in parameter leaves)"


def _product(ctx, e, pos, axis):
    """x·c, x/c: any factor that is not the scaled value commutes with the scale."""
    if e.primitive.name == "div" and pos == 1:
        return "a division by the channels"
    return axis


def _max(ctx, e, pos, axis):
    """max(x, 0): ReLU."""
    if _is_zero(ctx, _other(e, pos)):
        return axis
    return "max with a value other than 0 (not a ReLU)"


def _reduce(ctx, e, pos, axis):
    axes = tuple(e.params["axes"])
    if any(a in axes for a in _each(axis)):
        return f"{e.primitive.name} over the channels"
    return _one(tuple(a - sum(r < a for r in axes) for a in _each(axis)))


def _window(ctx, e, pos, axis):
    """Pooling (sum, max): a window of one along the channels."""
    p = e.params
    if isinstance(axis, tuple):
        return "pooling while the channels are split over axes"
    if p["window_dimensions"][axis] != 1 or p["window_strides"][axis] != 1 or \
            tuple(p["padding"][axis]) != (0, 0):
        return "pooling across channels"
    return axis


def _pad(ctx, e, pos, axis):
    if pos != 0 or not _is_zero(ctx, e.invars[1]):
        return "padding with a value other than 0"
    if isinstance(axis, tuple):
        return "padding while the channels are split over axes"
    if tuple(e.params["padding_config"][axis]) != (0, 0, 0):
        return "padding along the channels"
    return axis


def _each(axis) -> tuple:
    """The channel as a tuple of axes, most significant first (split over several axes —
    attention's heads — it is ``(head axis, feature axis)``, in any positions)."""
    return axis if isinstance(axis, tuple) else (axis,)


def _one(axes: tuple):
    return axes[0] if len(axes) == 1 else axes


def _transpose(ctx, e, pos, axis):
    perm = list(e.params["permutation"])
    return _one(tuple(perm.index(a) for a in _each(axis)))


def _reshape(ctx, e, pos, axis):
    """A reshape that keeps the channels whole and in order (the sizes before and after
    them unchanged): they may be split over consecutive axes (heads) or merged back."""
    old, new = e.invars[0].aval.shape, e.outvars[0].aval.shape
    ax = _each(axis)
    if list(ax) != list(range(ax[0], ax[0] + len(ax))):
        return "a reshape of channels split over axes that are not together"
    lo, hi = ax[0], ax[-1] + 1
    before, size = int(np.prod(old[:lo])), int(np.prod(old[lo:hi]))
    starts = [k for k in range(len(new) + 1) if int(np.prod(new[:k])) == before]
    for k in reversed(starts):                 # (after any unit axes before them)
        for m in range(k + 1, len(new) + 1):
            if int(np.prod(new[k:m])) == size:
                return _one(tuple(range(k, m)))
            if int(np.prod(new[k:m])) > size:
                break
    return "a reshape that merges the channels with another axis (a flatten)"


def _broadcast(ctx, e, pos, axis):
    """A broadcast copies each channel along new axes: the channel axis moves."""
    return _one(tuple(e.params["broadcast_dimensions"][a] for a in _each(axis)))


def _call(ctx, e, pos, axis):
    """A jit or custom-derivative call (ReLU is one): followed through its body."""
    body = C.call_body(e)[1]
    if body is None or len(e.outvars) != 1:
        return f"a {e.primitive.name} with several outputs"
    inner = body.jaxpr
    uses, producer = index_uses(inner)
    lits = {iv: (o.val if isinstance(o, C.Literal) else ctx.literals[o])
            for iv, o in zip(inner.invars, e.invars)
            if isinstance(o, C.Literal) or o in ctx.literals}
    sub = _Ctx(inner, uses, producer, {}, [], lits)
    v, a = inner.invars[pos], axis
    for _ in range(1000):
        u = uses.get(v, [])
        if len(u) != 1:
            return f"inside {e.primitive.name}: the channels are read {len(u)} times"
        ie, ipos = u[0]
        if ie is None:
            return a
        rule = RULES.get(ie.primitive.name) or (_call if ie.primitive.name in _CALLS else None)
        if rule is None:
            return f"{ie.primitive.name} (inside {e.params.get('name', e.primitive.name)}) " + \
                ("is not positively homogeneous" if ie.primitive.name in NOT_HOMOGENEOUS
                 else "is not one equalization passes through")
        got = rule(sub, ie, ipos, a)
        if isinstance(got, str):
            return got
        v, a = ie.outvars[0], got
    return "the path is too long"


RULES = {"add": _bias, "sub": _bias, "mul": _product, "div": _product, "max": _max,
         "reduce_sum": _reduce, "reduce_max": _reduce, "reduce_window_sum": _window,
         "reduce_window_max": _window, "pad": _pad, "transpose": _transpose,
         "reshape": _reshape, "squeeze": _reshape, "expand_dims": _reshape,
         "broadcast_in_dim": _broadcast, **{p: (lambda ctx, e, pos, axis: axis) for p in _PASS}}
