"""The residual stream of a decoder, read from a jaxpr, for rotation
(:mod:`hlofold._core.rotation`).

The stream starts at an embedding (a ``gather`` from a parameter table) and is followed
through every use: additions of stream values and of layer outputs (the *writers*, with
their biases), casts, normalization — the stream's square summed over its channels, its sum
over the channels (LayerNorm's mean), a value per token added to or subtracted from it (the
mean taken out), the stream times (or over) a product of values per token and norm scales
whose values are all equal (γ folded: ones), a norm's offset vector added (β: rotated with
the stream) — and the layers that read it (the *readers*: a dot contracting the channels
with a parameter kernel). A sum over the channels or a value per token added makes the
rotation one that keeps the all-ones direction (``Q·1 = 1``: the sum, so the mean, is then
the same for ``x·Q``). Anything else — a per-channel γ, the stream as an output, a nonlinear
function of it — and nothing is rotated, with the reason.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import _compat as C
from .._core.chain_rules import is_float
from .pair_rules import index_uses, leaf_of

_CASTS = {"convert_element_type", "copy", "reduce_precision"}


@dataclasses.dataclass
class Stream:
    """What rotating the stream changes: ``(leaf index, axis)`` of the embedding's features,
    the readers' input rows, the writers' output channels and their biases, the norms'
    offsets; the norm scales (leaf indices) that must be all equal; whether ``Q`` must keep
    the all-ones direction."""

    embedding: tuple
    readers: list = dataclasses.field(default_factory=list)
    writers: list = dataclasses.field(default_factory=list)
    scales: list = dataclasses.field(default_factory=list)
    width: int = 0
    shifts: list = dataclasses.field(default_factory=list)   # (β leaf, axis): rotated too
    centered: bool = False      # a channel sum or a per-token shift: Q must keep 1


def find_stream(jaxpr, n_leaves: int) -> Stream | str:
    """The stream of ``jaxpr`` (its first ``n_leaves`` inputs the parameter leaves), or why
    it cannot be rotated."""
    uses, producer = index_uses(jaxpr)
    leaves = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    tables = [e for e in jaxpr.eqns if e.primitive.name == "gather" and e.invars[0] in leaves
              and e.invars[0].aval.ndim == 2]
    if len(tables) != 1:
        return (f"{len(tables)} embedding tables (a gather from a 2-D parameter) where one "
                f"starts the residual stream")
    table = tables[0]
    out = table.outvars[0]
    if len(uses.get(table.invars[0], [])) != 1:
        return "the embedding table is read elsewhere too (a tied head: untie it first)"
    width = int(out.aval.shape[-1])
    s = Stream((leaves[table.invars[0]], 1), width=width)
    stream, normed, done = {out}, set(), set()
    work = [out]
    while work:
        v = work.pop()
        last = v.aval.ndim - 1
        for e, pos in uses.get(v, []):
            if e is None:
                return "the residual stream is an output of the program"
            if id(e) in done and e.primitive.name == "add":
                continue
            why = _use(e, pos, v, last, v in normed, stream, normed, work, s, leaves,
                       producer, uses)
            if why:
                return why
            done.add(id(e))
    if not s.readers:
        return "no layer reads the residual stream"
    for i, _ in [*s.readers, *s.writers, *s.shifts]:
        if len(uses.get(jaxpr.invars[i], [])) != 1:
            return f"a weight the stream's rotation changes (leaf {i}) is read elsewhere too"
    return s


def _use(e, pos, v, last, is_normed, stream, normed, work, s, leaves, producer, uses):
    name = e.primitive.name
    o = e.outvars[0] if e.outvars else None

    def more(x, norm=False):
        if x not in stream and x not in normed:
            (normed if norm else stream).add(x)
            work.append(x)
    if name in ("squeeze", "reshape") and o.aval.ndim and o.aval.shape[-1] == v.aval.shape[-1] \
            and (name == "reshape" or last not in e.params["dimensions"]):
        more(o, is_normed)          # (a gather's slice axis squeezed: the channels stay last)
        return None
    if name in _CASTS:
        if not is_float(o.aval.dtype):
            return f"{name} of the residual stream to {o.aval.dtype} (not a float)"
        more(o, is_normed)
        return None
    if name == "dot_general":
        (lc, rc), (lb, _) = e.params["dimension_numbers"]
        mine, theirs = (lc, rc) if pos == 0 else (rc, lc)
        kernel = leaf_of(e.invars[1 - pos], leaves, producer, uses)
        if kernel is None or tuple(mine) != (last,) or lb:
            return "a dot reads the residual stream other than as a layer with a parameter kernel"
        s.readers.append((leaves[kernel], theirs[0]))    # (Equinox: W @ x, the kernel first)
        return None
    other = e.invars[1 - pos] if len(e.invars) == 2 else None
    tracked = isinstance(other, C.Var) and (other in stream or other in normed)
    if name in ("mul", "div") and not tracked and (name == "mul" or pos == 0) and \
            (isinstance(other, C.Literal) or not other.aval.shape):
        more(o, is_normed)          # x · √d (Gemma's embedding): a number commutes with Q
        return None
    if name in ("mul", "div") and not (name == "mul" and e.invars[0] is e.invars[1]) and \
            (name == "mul" or pos == 0) and not tracked:
        why = _factors(other, last, s, leaves, producer, uses)
        if why is None:
            more(o, True)           # x · rsqrt(mean(x²) + ε) · γ: per token, γ all equal
            return None
        if is_normed or name == "div":
            return why
    if is_normed:
        if name in ("add", "sub") and not tracked:
            why = _terms(other, last, s, leaves, producer, uses, True)
            if why is None:
                more(o, True)       # + β (rotated with the stream), − mean·γ·rsqrt
                return None
            return why
        return f"{name} reads the normalized stream"
    if name in ("add", "sub"):
        if isinstance(other, C.Var) and other in stream:
            if name == "sub":
                return "a difference of two residual stream values"
            more(o)
            return None
        saved = (s.centered, len(s.scales))
        if _terms(other, last, s, leaves, producer, uses, False) is None:
            more(o)                 # x − mean(x): a value per token
            return None
        s.centered = saved[0]
        del s.scales[saved[1]:]
        if name == "sub":
            return "something other than a value per token is subtracted from the stream"
        why = _writer(other, last, s, leaves, producer, uses)
        if why:
            return why
        more(o)
        return None
    if name in ("square", "integer_pow", "mul", "pow") and \
            (name != "integer_pow" or e.params.get("y") == 2) and \
            (name != "pow" or (pos == 0 and _is_two(e.invars[1]))) and \
            (name != "mul" or e.invars[0] is e.invars[1]):
        u = uses.get(o, [])
        if len(u) == 1 and u[0][0] is not None and u[0][0].primitive.name == "reduce_sum" \
                and tuple(u[0][0].params["axes"]) == (last,):
            return None             # Σ x² over the channels: the same for x·Q
        return "the square of the residual stream is read other than summed over its channels"
    if name == "mul":
        return "the residual stream is multiplied by a per-channel value (a norm's γ not folded)"
    if name == "reduce_sum":
        if tuple(e.params["axes"]) != (last,):
            return "a sum of the residual stream over other axes than its channels"
        s.centered = True           # Σ_j x_j: the same for x·Q where Q·1 = 1
        return None
    return f"{name} reads the residual stream"


_ELEMENTWISE = {"add", "sub", "mul", "div", "max", "min", "pow", "neg", "rsqrt", "sqrt",
                "exp", "log", "abs", "square", "integer_pow", "reciprocal", "logistic",
                "tanh", "select_n", "stop_gradient", *_CASTS}


def _per_token(v, last, producer, depth=0) -> bool:
    """``v`` is the same for every channel: a scalar, a size-1 channel axis, broadcast
    from a value without it, or elementwise of such values (``rsqrt(mean + ε)``)."""
    if isinstance(v, C.Literal) or not v.aval.shape:
        return True
    if len(v.aval.shape) != last + 1 or depth > 8:
        return False
    if v.aval.shape[last] == 1:
        return True
    p = producer.get(v)
    if p is None:
        return False
    if p.primitive.name == "broadcast_in_dim":
        dims = tuple(p.params["broadcast_dimensions"])
        return last not in dims or p.invars[0].aval.shape[dims.index(last)] == 1
    return p.primitive.name in _ELEMENTWISE and all(
        _per_token(x, last, producer, depth + 1) for x in p.invars)


def _zero(v, producer) -> bool:
    """``v`` is a literal zero (broadcast or cast): adding it changes nothing."""
    for _ in range(4):
        if isinstance(v, C.Literal):
            return np.ndim(v.val) == 0 and float(v.val) == 0.0
        p = producer.get(v)
        if p is None or p.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            return False
        v = p.invars[0]
    return False


def _factors(v, last, s, leaves, producer, uses, depth=0):
    """None where ``v`` is a product of values per token and norm scales (the scales'
    leaves added to ``s.scales``: they must be all equal), or why not."""
    why = "the residual stream is multiplied by a per-channel value (a norm's γ not folded)"
    if depth > 8:
        return why
    if _per_token(v, last, producer):
        return None
    g = leaf_of(v, leaves, producer, uses)
    if g is not None:
        if g.aval.ndim != 1 or g.aval.shape[0] != s.width:
            return why
        s.scales.append(leaves[g])
        return None
    p = producer.get(v)
    if p is None:
        return why
    name = p.primitive.name
    if name in ("mul", "div"):
        return _factors(p.invars[0], last, s, leaves, producer, uses, depth + 1) or \
            _factors(p.invars[1], last, s, leaves, producer, uses, depth + 1)
    if name in _CASTS | {"neg", "broadcast_in_dim", "reshape"} and \
            p.invars[0].aval.shape[-1:] == v.aval.shape[-1:]:
        return _factors(p.invars[0], last, s, leaves, producer, uses, depth + 1)
    return why


def _terms(v, last, s, leaves, producer, uses, normed, depth=0):
    """None where ``v``, added to the stream, is a sum of values per token (``s.centered``:
    Q must keep the all-ones direction) and — where the stream is normalized — of offset
    vectors (β: added to ``s.shifts``, rotated with the stream); why not otherwise."""
    why = "something other than a value per token is added to the stream"
    if depth > 8:
        return why
    if _zero(v, producer):
        return None
    p = producer.get(v) if not isinstance(v, C.Literal) else None
    if normed:
        b = leaf_of(v, leaves, producer, uses)
        if b is not None:
            if b.aval.ndim != 1 or b.aval.shape[0] != s.width:
                return "an offset added to the normalized stream is not a vector over its channels"
            s.shifts.append((leaves[b], 0))
            return None
    if p is not None and p.primitive.name in ("add", "sub"):
        return _terms(p.invars[0], last, s, leaves, producer, uses, normed, depth + 1) or \
            _terms(p.invars[1], last, s, leaves, producer, uses, normed, depth + 1)
    if p is not None and p.primitive.name == "neg":
        return _terms(p.invars[0], last, s, leaves, producer, uses, normed, depth + 1)
    n = len(s.scales)
    if _factors(v, last, s, leaves, producer, uses) is None:
        s.centered = True
        return None
    del s.scales[n:]
    return why


def _is_two(x) -> bool:
    """A literal 2 (Keras' RMSNorm squares with ``ops.power(x, 2)``)."""
    return isinstance(x, C.Literal) and np.ndim(x.val) == 0 and float(x.val) == 2.0


def _writer(v, last, s, leaves, producer, uses):
    """A layer's output added into the stream: its kernel (and a bias added to it), through
    casts and transposes (Equinox's ``W @ x`` under ``vmap``: the channels first, moved
    last); every value on the way read only there."""
    other = "something other than a layer's output is added into the residual stream"
    bias, axis = None, last
    p = producer.get(v)
    while p is not None and p.primitive.name in _CASTS | {"add", "transpose"}:
        if len(uses.get(v, [])) != 1:
            return "a layer's output is read elsewhere too before it is added into the stream"
        if p.primitive.name == "add":
            for k in (0, 1):
                b = leaf_of(p.invars[k], leaves, producer, uses)
                if b is not None and bias is None and b.aval.ndim == 1:
                    bias, v = leaves[b], p.invars[1 - k]
                    break
            else:
                return other
        else:
            if p.primitive.name == "transpose":
                axis = p.params["permutation"][axis]
            v = p.invars[0]
        p = producer.get(v)
    if p is None or p.primitive.name != "dot_general" or len(uses.get(v, [])) != 1:
        return other
    (lc, rc), (lb, rb) = p.params["dimension_numbers"]
    for kpos, kc, kb in ((1, rc, rb), (0, lc, lb)):
        k = leaf_of(p.invars[kpos], leaves, producer, uses)
        if k is not None:
            break
    if k is None or lb:
        return "a layer writing into the residual stream has no parameter kernel of one output axis"
    free = [d for d in range(p.invars[kpos].aval.ndim) if d not in kc and d not in kb]
    x = p.invars[1 - kpos]
    x_free = x.aval.ndim - len(rc if kpos == 0 else lc)
    if len(free) != 1:
        return "a layer writing into the residual stream has no parameter kernel of one output axis"
    if (x_free if kpos == 1 else 0) != axis:
        return "a layer's output channels do not reach the residual stream's channels"
    s.writers.append((leaves[k], free[0]))
    if bias is not None:
        s.writers.append((bias, 0))
    return None
