"""The residual stream of a decoder, read from a jaxpr, for rotation
(:mod:`hlofold._core.rotation`).

The stream starts at an embedding (a ``gather`` from a parameter table) and is followed
through every use: additions of stream values and of layer outputs (the *writers*, with
their biases), casts, RMS normalization (the square of the stream summed over its
channels, anything per token after that, and the stream times that per-token value), a
norm's scale whose values are all equal (γ folded: ones), and the layers that read it (the
*readers*: a dot contracting the channels with a parameter kernel). Anything else — a mean
over the channels (LayerNorm's centering), a per-channel γ, the stream as an output, a
nonlinear function of it — and nothing is rotated, with the reason.
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
    the readers' input rows, the writers' output channels and their biases; the norm
    scales (leaf indices) that must be all equal."""

    embedding: tuple
    readers: list = dataclasses.field(default_factory=list)
    writers: list = dataclasses.field(default_factory=list)
    scales: list = dataclasses.field(default_factory=list)
    width: int = 0


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
    return s


def _use(e, pos, v, last, is_normed, stream, normed, work, s, leaves, producer, uses):
    name = e.primitive.name
    o = e.outvars[0] if e.outvars else None

    def more(x, norm=False):
        if x not in stream and x not in normed:
            (normed if norm else stream).add(x)
            work.append(x)
    if name in _CASTS:
        if not is_float(o.aval.dtype):
            return f"{name} of the residual stream to {o.aval.dtype} (not a float)"
        more(o, is_normed)
        return None
    if name == "dot_general":
        (lc, rc), (lb, _) = e.params["dimension_numbers"]
        k = e.invars[1 - pos]
        kernel = leaf_of(k, leaves, producer, uses) if pos == 0 else None
        if kernel is None or tuple(lc) != (last,) or lb:
            return "a dot reads the residual stream other than as a layer with a parameter kernel"
        s.readers.append((leaves[kernel], rc[0]))
        return None
    if is_normed:
        if name == "mul":
            g = leaf_of(e.invars[1 - pos], leaves, producer, uses)
            if g is None:
                return "the normalized stream is multiplied by a computed per-channel value"
            s.scales.append(leaves[g])
            more(o, True)
            return None
        return f"{name} reads the normalized stream"
    if name == "add":
        other = e.invars[1 - pos]
        if other in stream:
            more(o)
            return None
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
        r = e.invars[1 - pos]
        shape = getattr(getattr(r, "aval", None), "shape", ())
        if len(shape) == len(v.aval.shape) and shape[last] == 1 and r not in stream:
            more(o, True)           # x · rsqrt(mean(x²) + ε): one value per token
            return None
        return "the residual stream is multiplied by a per-channel value (a norm's γ not folded)"
    if name == "reduce_sum":
        return "a sum over the residual stream's channels (LayerNorm's mean: rotate RMSNorm models)"
    return f"{name} reads the residual stream"


def _is_two(x) -> bool:
    """A literal 2 (Keras' RMSNorm squares with ``ops.power(x, 2)``)."""
    return isinstance(x, C.Literal) and np.ndim(x.val) == 0 and float(x.val) == 2.0


def _writer(v, last, s, leaves, producer, uses):
    """A layer's output added into the stream: its kernel (and a bias added to it)."""
    bias = None
    p = producer.get(v)
    while p is not None and p.primitive.name in _CASTS | {"add"}:
        if p.primitive.name == "add":
            for k in (0, 1):
                b = leaf_of(p.invars[k], leaves, producer, uses)
                if b is not None and bias is None and b.aval.ndim == 1:
                    bias, v = leaves[b], p.invars[1 - k]
                    break
            else:
                return "something other than a layer's output is added into the residual stream"
        else:
            v = p.invars[0]
        p = producer.get(v)
    if p is None or p.primitive.name != "dot_general" or len(uses.get(v, [])) != 1:
        return "something other than a layer's output is added into the residual stream"
    (lc, rc), (lb, rb) = p.params["dimension_numbers"]
    k = leaf_of(p.invars[1], leaves, producer, uses)
    free = [d for d in range(p.invars[1].aval.ndim) if d not in rc and d not in rb]
    if k is None or len(free) != 1 or lb:
        return "a layer writing into the residual stream has no parameter kernel of one output axis"
    s.writers.append((leaves[k], free[0]))
    if bias is not None:
        s.writers.append((bias, 0))
    return None

