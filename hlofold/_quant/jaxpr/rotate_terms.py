"""How a value meets the residual stream, for :mod:`hlofold._quant.jaxpr.rotate`: the same for
every channel (a value per token: a scalar, a size-1 channel axis, a broadcast, elementwise of
such), a product of such values and norm scales (``rsqrt(mean(x²) + ε)·γ``), a sum of values
per token and — on the normalized stream — norms' offset vectors (``β − mean·inv``). A
rotation ``Q`` commutes with multiplying by the first two; a value per token added to the
stream needs ``Q·1 = 1`` (``Stream.centered``); an offset is rotated with the stream."""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import is_float
from hlofold._fold.core.rules import narrowing_cast
from hlofold._ir.jaxpr import ops
from .pair_rules import leaf_of, literal_zero

# the values as they are, maybe rounded (see ``rounds``)
CASTS = ops.names(lambda o: o.shape in ("cast", "copy", "constraint") or o.rounding == "always")
ELEMENTWISE = ops.names(lambda o: o.elementwise)


def rounds(e) -> str | None:
    """What ``e`` rounds its float values to — ``reduce_precision``, or a convert to a float
    that cannot hold its operand (the fold chain's rule, ``narrowing_cast``) — or None: a
    rotation does not commute with a rounding."""
    facts = ops.of(e.primitive.name)
    if facts.rounding == "always":
        return (f"{e.params.get('mantissa_bits', '?')} mantissa bits "
                f"(reduce_precision)")
    if facts.rounding == "narrowing":
        src, dst = e.invars[0].aval.dtype, e.outvars[0].aval.dtype
        if is_float(src) and is_float(dst) and narrowing_cast(src, dst) is not None:
            return np.dtype(dst).name
    return None


def per_token(v, last, producer, depth=0) -> bool:
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
    return p.primitive.name in ELEMENTWISE and all(
        per_token(x, last, producer, depth + 1) for x in p.invars)


def factors(v, last, s, leaves, producer, uses, depth=0):
    """None where ``v`` is a product of values per token and norm scales (the scales'
    leaves added to ``s.scales``: they must be all equal), or why not."""
    why = "the residual stream is multiplied by a per-channel value (a norm's γ not folded)"
    if depth > 8:
        return why
    if per_token(v, last, producer):
        return None
    g = leaf_of(v, leaves, producer, uses)
    if g is not None:
        if g.aval.ndim != 1 or g.aval.shape[0] != s.width:
            return why
        s.scales.append(leaves[g][0])
        return None
    p = producer.get(v)
    if p is None:
        return why
    name = p.primitive.name
    if name in ("mul", "div"):
        return factors(p.invars[0], last, s, leaves, producer, uses, depth + 1) or \
            factors(p.invars[1], last, s, leaves, producer, uses, depth + 1)
    if name in CASTS | {"neg", "broadcast_in_dim", "reshape"} and \
            p.invars[0].aval.shape[-1:] == v.aval.shape[-1:]:
        return factors(p.invars[0], last, s, leaves, producer, uses, depth + 1)
    return why


def terms(v, last, s, leaves, producer, uses, normed, depth=0):
    """None where ``v``, added to the stream, is a sum of values per token (``s.centered``:
    Q must keep the all-ones direction) and — where the stream is normalized — of offset
    vectors (β: added to ``s.shifts``, rotated with the stream); why not otherwise."""
    why = "something other than a value per token is added to the stream"
    if depth > 8:
        return why
    if literal_zero(v, producer):
        return None
    p = producer.get(v) if not isinstance(v, C.Literal) else None
    if normed:
        b = leaf_of(v, leaves, producer, uses)
        if b is not None:
            if b.aval.ndim != 1 or b.aval.shape[0] != s.width:
                return "an offset added to the normalized stream is not a vector over its channels"
            s.shifts.append(leaves[b])
            return None
    if p is not None and p.primitive.name in ("add", "sub"):
        return terms(p.invars[0], last, s, leaves, producer, uses, normed, depth + 1) or \
            terms(p.invars[1], last, s, leaves, producer, uses, normed, depth + 1)
    if p is not None and p.primitive.name == "neg":
        return terms(p.invars[0], last, s, leaves, producer, uses, normed, depth + 1)
    n = len(s.scales)
    if factors(v, last, s, leaves, producer, uses) is None:
        s.centered = True
        return None
    del s.scales[n:]
    return why
