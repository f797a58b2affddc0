"""The residual stream of a decoder, read from a jaxpr, for rotation
(:mod:`hlofold._quant.core.rotation`).

The stream starts at an embedding (a ``gather`` from a parameter table) and is followed
through every use: additions of stream values and of layer outputs (the *writers*, with
their biases), casts, normalization — the stream's square summed over its channels, its sum
over the channels (LayerNorm's mean), a value per token added to or subtracted from it (the
mean taken out), the stream times (or over) a product of values per token and norm scales
whose values are all equal (γ folded: ones), a norm's offset vector added (β: rotated with
the stream) — and the layers that read it (the *readers*: a dot contracting the channels
with a parameter kernel). A sum over the channels or a value per token added makes the
rotation one that keeps the all-ones direction (``Q·1 = 1``: the sum, so the mean, is then
the same for ``x·Q``). A scan whose carry is the stream (a scanned layer stack) is entered
and its body read the same way, its stacked weights' rows standing for the stacks. One rule
per primitive (:data:`_RULES`). Anything else — a per-channel γ, the stream as an output, a
nonlinear function of it — and nothing is rotated, with the reason.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import is_float
from hlofold._ir.jaxpr import ops
from hlofold._ir.jaxpr.uses import index_uses
from .pair_rules import leaf_of, varying_axis
from .rotate_terms import CASTS, factors, rounds, terms


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


class _Level:
    """One jaxpr the walk is in (the program, or a scan's body): its uses, producers, the
    leaves it reads (var → (leaf index, axis offset): a stacked leaf's rows one axis less),
    and the stream's values found in it."""

    def __init__(self, jaxpr, leaves: dict):
        self.jaxpr, self.leaves = jaxpr, leaves
        self.uses, self.producer = index_uses(jaxpr)
        self.stream, self.normed, self.done, self.work = set(), set(), set(), []

    def ref(self, v, axis: int) -> tuple:
        i, off = self.leaves[v]
        return i, axis + off

    def more(self, x, norm=False):
        if x not in self.stream and x not in self.normed:
            (self.normed if norm else self.stream).add(x)
            self.work.append(x)


def find_stream(jaxpr, n_leaves: int) -> Stream | str:
    """The stream of ``jaxpr`` (its first ``n_leaves`` inputs the parameter leaves), or why
    it cannot be rotated."""
    top = _Level(jaxpr, {v: (i, 0) for i, v in enumerate(jaxpr.invars[:n_leaves])})
    tables = [e for e in jaxpr.eqns if e.primitive.name == "gather" and
              e.invars[0] in top.leaves and e.invars[0].aval.ndim == 2]
    if len(tables) != 1:
        return (f"{len(tables)} embedding tables (a gather from a 2-D parameter) where one "
                f"starts the residual stream")
    table = tables[0]
    out = table.outvars[0]
    if len(top.uses.get(table.invars[0], [])) != 1:
        return "the embedding table is read elsewhere too (a tied head: untie it first)"
    s = Stream(top.ref(table.invars[0], 1), width=int(out.aval.shape[-1]))
    top.more(out)
    why = _walk(top, s, lambda v, lv: "the residual stream is an output of the program")
    if why:
        return why
    if not s.readers:
        return "no layer reads the residual stream"
    for i, _ in [*s.readers, *s.writers, *s.shifts]:
        if len(top.uses.get(jaxpr.invars[i], [])) != 1:
            return f"a weight the stream's rotation changes (leaf {i}) is read elsewhere too"
    return s


def _walk(lv: _Level, s: Stream, at_output) -> str | None:
    """Every use of the stream's values in ``lv``; ``at_output(v, lv)``: why the value
    ``v`` cannot be an output of this jaxpr (None: it can)."""
    while lv.work:
        v = lv.work.pop()
        last = v.aval.ndim - 1
        for e, pos in lv.uses.get(v, []):
            if e is None:
                why = at_output(v, lv)
                if why:
                    return why
                continue
            if id(e) in lv.done and e.primitive.name == "add":
                continue
            why = _use(e, pos, v, last, v in lv.normed, lv, s)
            if why:
                return why
            lv.done.add(id(e))
    return None


def _scan(e, pos, v, lv: _Level, s: Stream) -> str | None:
    """The stream as a scan's carry (``nn.scan``, MaxText): each layer's body read as the
    program is, its stacked weights' rows standing for the stacks (one ``Q`` for every
    layer: the carry is shared); the carry out the stream again."""
    try:
        nc, ncar, _ = C.scan_layout(e)
        body = C.scan_body(e)[0].jaxpr
    except C.CompatError as err:            # (a JAX whose scan hlofold has not seen)
        return f"a scan reads the residual stream, and {err}"
    if not nc <= pos < nc + ncar or v in lv.normed:
        return "a scan reads the residual stream other than as its carry"
    if id(e) in lv.done:
        return "the residual stream is two carries of one scan"
    k = pos - nc
    leaves = {}
    for j, u in enumerate(e.invars):
        if isinstance(u, C.Var) and u in lv.leaves and (j < nc or j >= nc + ncar):
            i, off = lv.leaves[u]
            leaves[body.invars[j]] = (i, off + (j >= nc + ncar))
    inner = _Level(body, leaves)
    inner.more(body.invars[nc + k])
    reached = []

    def at_output(x, b):
        if x in b.normed or [o for o in body.outvars if o is x] != [body.outvars[k]]:
            return "the residual stream is a scan's output other than its carry"
        reached.append(x)
        return None
    found = [len(s.readers), len(s.writers), len(s.shifts)]
    why = _walk(inner, s, at_output)
    if why:
        return why
    if not reached:
        return "a scan's carry out is not the residual stream it was given"
    body_var = {r[0]: b for b, r in leaves.items()}
    for got, n in zip((s.readers, s.writers, s.shifts), found):
        if any(len(inner.uses.get(body_var[i], [])) != 1 for i, _ in got[n:]):
            return "a weight the stream's rotation changes is read twice in a scan's body"
    lv.more(e.outvars[k])
    return None


def _use(e, pos, v, last, is_normed, lv: _Level, s: Stream) -> str | None:
    """One use of a stream value ``v`` (operand ``pos`` of ``e``): by the primitive's rule
    in :data:`_RULES`, or why it cannot be rotated."""
    rule = _RULES.get(e.primitive.name)
    return _other(e, is_normed) if rule is None else rule(e, pos, v, last, is_normed, lv, s)


def _other(e, is_normed) -> str:
    return f"{e.primitive.name} reads the {'normalized' if is_normed else 'residual'} stream"


def _keep_channels(e, pos, v, last, is_normed, lv, s):
    """squeeze, reshape: the channels stay last (a gather's slice axis squeezed)."""
    o = e.outvars[0]
    if o.aval.ndim and o.aval.shape[-1] == v.aval.shape[-1] and \
            (e.primitive.name == "reshape" or last not in e.params["dimensions"]):
        lv.more(o, is_normed)
        return None
    return _other(e, is_normed)


def _cast(e, pos, v, last, is_normed, lv, s):
    o = e.outvars[0]
    if not is_float(o.aval.dtype):
        return f"{e.primitive.name} of the residual stream to {o.aval.dtype} (not a float)"
    if (to := rounds(e)) is not None:
        return (f"the residual stream is rounded to {to} ({e.primitive.name}): a rotation "
                f"does not commute with rounding; keep the stream in one float type")
    lv.more(o, is_normed)
    return None


def _reader(e, pos, v, last, is_normed, lv, s):
    """dot_general: a layer reading the stream, its kernel's input rows (Equinox's
    ``W @ x``: the kernel first)."""
    (lc, rc), (lb, _) = e.params["dimension_numbers"]
    mine, theirs = (lc, rc) if pos == 0 else (rc, lc)
    kernel = leaf_of(e.invars[1 - pos], lv.leaves, lv.producer, lv.uses)
    if kernel is None or tuple(mine) != (last,) or lb:
        return "a dot reads the residual stream other than as a layer with a parameter kernel"
    s.readers.append(lv.ref(kernel, theirs[0]))
    return None


def _tracked(x, lv) -> bool:
    return isinstance(x, C.Var) and (x in lv.stream or x in lv.normed)


def _scale(e, pos, v, last, is_normed, lv, s):
    """mul, div: by a number (Gemma's ``x·√d``: the same state), by values per token and
    norm scales (``x·rsqrt(mean(x²) + ε)·γ``: normalized); ``x·x`` is a square."""
    name, o = e.primitive.name, e.outvars[0]
    if name == "mul" and e.invars[0] is e.invars[1]:
        return _square(e, pos, v, last, is_normed, lv, s)
    other = e.invars[1 - pos]
    if not _tracked(other, lv) and (name == "mul" or pos == 0):
        if isinstance(other, C.Literal) or not other.aval.shape:
            lv.more(o, is_normed)
            return None
        why = factors(other, last, s, lv.leaves, lv.producer, lv.uses)
        if why is None:
            lv.more(o, True)
            return None
        if is_normed or name == "div":
            return why
    if is_normed or name == "div":
        return _other(e, is_normed)
    return "the residual stream is multiplied by a per-channel value (a norm's γ not folded)"


def _shift(e, pos, v, last, is_normed, lv, s):
    """add, sub: of the stream (a residual add), of values per token (LayerNorm's mean; on
    the normalized stream norms' offsets too, rotated), or of a layer's output (a writer)."""
    name, o = e.primitive.name, e.outvars[0]
    other = e.invars[1 - pos]
    args = (other, last, s, lv.leaves, lv.producer, lv.uses)
    if is_normed:
        if _tracked(other, lv):
            return _other(e, True)
        why = terms(*args, True)
        if why is None:
            lv.more(o, True)
        return why
    if isinstance(other, C.Var) and other in lv.stream:
        if name == "sub":
            return "a difference of two residual stream values"
        lv.more(o)
        return None
    saved = (s.centered, len(s.scales))
    if terms(*args, False) is None:
        lv.more(o)
        return None
    s.centered = saved[0]
    del s.scales[saved[1]:]
    if name == "sub":
        return "something other than a value per token is subtracted from the stream"
    why = _writer(other, last, s, lv)
    if why is None:
        lv.more(o)
    return why


def _square(e, pos, v, last, is_normed, lv, s):
    """square, x², x·x: only summed over the channels (the same for ``x·Q``)."""
    name = e.primitive.name
    if is_normed or (name == "integer_pow" and e.params.get("y") != 2) or \
            (name == "pow" and not (pos == 0 and _is_two(e.invars[1]))):
        return _other(e, is_normed)
    u = lv.uses.get(e.outvars[0], [])
    if len(u) == 1 and u[0][0] is not None and u[0][0].primitive.name == "reduce_sum" \
            and tuple(u[0][0].params["axes"]) == (last,):
        return None
    return "the square of the residual stream is read other than summed over its channels"


def _sum(e, pos, v, last, is_normed, lv, s):
    """reduce_sum over the channels: the same for ``x·Q`` where ``Q·1 = 1``."""
    if is_normed:
        return _other(e, True)
    if tuple(e.params["axes"]) != (last,):
        return "a sum of the residual stream over other axes than its channels"
    s.centered = True
    return None


_RULES = {"squeeze": _keep_channels, "reshape": _keep_channels,
          **{c: _cast for c in CASTS}, "dot_general": _reader, "mul": _scale, "div": _scale,
          "add": _shift, "sub": _shift, "square": _square, "integer_pow": _square,
          "pow": _square, "reduce_sum": _sum,
          "scan": lambda e, pos, v, last, is_normed, lv, s: _scan(e, pos, v, lv, s)}


def _is_two(x) -> bool:
    """A literal 2 (Keras' RMSNorm squares with ``ops.power(x, 2)``)."""
    return isinstance(x, C.Literal) and np.ndim(x.val) == 0 and float(x.val) == 2.0


# what may stand between a layer writing into the stream and the add: casts, its bias, a
# transpose (Equinox's channels-first output)
_WRITER_PATH = CASTS | ops.names(lambda o: o.affine == "add" or o.shape == "transpose")


def _writer(v, last, s, lv: _Level):
    """A layer's output added into the stream: its kernel (and a bias added to it), through
    casts and transposes (Equinox's ``W @ x`` under ``vmap``: the channels first, moved
    last); every value on the way read only there."""
    other = "something other than a layer's output is added into the residual stream"
    bias, axis = None, last
    leaves, producer, uses = lv.leaves, lv.producer, lv.uses
    p = producer.get(v)
    while p is not None and p.primitive.name in _WRITER_PATH:
        if len(uses.get(v, [])) != 1:
            return "a layer's output is read elsewhere too before it is added into the stream"
        if (to := rounds(p)) is not None:
            return (f"a layer's output is rounded to {to} ({p.primitive.name}) before it is "
                    f"added into the stream: a rotation does not commute with rounding")
        if p.primitive.name == "add":
            for k in (0, 1):
                b = leaf_of(p.invars[k], leaves, producer, uses)
                if b is not None and bias is None and b.aval.ndim == 1 and \
                        varying_axis(producer, p.invars[k], p.outvars[0].aval.ndim) == axis:
                    bias, v = lv.ref(b, 0), p.invars[1 - k]
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
    s.writers.append(lv.ref(k, free[0]))
    if bias is not None:
        s.writers.append(bias)
    return None
