"""The chain *in front of* a root, walked once for both IR adapters.

``root(x·s + t, K) = root(x, K ⊙_in s) + root(t, K)`` for ``s``/``t`` per input feature.
:func:`walk_forward` follows the root's input back through per-input-channel affine ops; an
IR adapter (:class:`ForwardIR`: ``_fold.jaxpr.forward.JaxprForwardIR`` on a jaxpr,
``_fold.stablehlo.forward.HloForwardIR`` on StableHLO) says what an op is and what it computes from.
The rules that decide are here, once:

* a value before the root has one reader (the root's input may feed several linear roots:
  ``_fold.core.decide.forward_consumers_refusal``, asked of the adapter);
* an operand is not computed from the activations; where both operands of an op look
  per-channel, the chain value is the one not known now, and computed (the other an input);
* LayerNorm/RMSNorm **per-token factors**: a ``mul`` by a value constant along the feature
  axis (the ``rsqrt`` of a token's variance) is not absorbed: it stays in the graph and the
  root reads ``x·r``; a ``mul`` by a product ``r ⊗ γ`` (Flax, Haiku) is split, ``r`` kept and
  ``γ`` absorbed; Keras's ``x·P + (u·P + β)`` is ``(x + u)·P + β`` (the per-token ``+u``
  kept).
  A token factor commutes with per-feature scales only: once one is passed, the chain takes
  ``mul``/``div``/``neg`` steps only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from hlofold._base.reasons import Reason

_SCALE_KINDS = ("mul", "div", "neg")
PASS = "pass"     # an identity on the values (a sharding constraint): replayed, not folded
# (a shape op next to the root that keeps the channels whole is replayed as well: pass_axis)
_ELEMENTWISE = ("add", "sub", "mul", "div", "neg", "elementwise")

AMBIGUOUS = Reason("feature-axis", "both operands of the op before the root look per-channel")
LONE_SHIFT = Reason("chain-end", "a per-token shift (LayerNorm's −μ·r·γ) without the product "
                    "it distributes over")


class ForwardIR(Protocol):
    """What :func:`walk_forward` needs of an IR (one root at a time)."""

    def producer(self, value) -> Any:
        """The op computing ``value``; None for an input, a literal, a value from outside
        the root's region."""

    def takeable(self, op) -> bool:
        """Whether ``op`` is a float affine op (add, sub, mul, div, neg) the chain may take
        (not an op of an earlier root's chain after it; in the root's region)."""

    def kind(self, op) -> str:
        """``mul``, ``add``, ``sub``, ``div``, ``neg``, ``broadcast_in_dim``, ``elementwise``
        (any other op computing each element from the same element of its operands),
        ``pass`` (an identity on the values: a sharding constraint, which ``takeable``
        admits), or ``other``."""

    def pass_axis(self, op, axis: int) -> int | None:
        """Where ``op`` passes the values as they are — a sharding constraint, a copy, or a
        shape op that keeps the channels whole (replayed on the root's new input): the
        channels' axis in its operand; None for any other op."""

    def operands(self, op) -> list: ...

    def result(self, op) -> Any: ...

    def shape(self, value) -> tuple | None:
        """The value's shape; None for a literal."""

    def broadcast_dims(self, op) -> tuple:
        """A ``broadcast_in_dim``'s dimensions."""

    def affine(self, op, pos: int, axis: int) -> tuple[Any, Any] | None:
        """``op`` reading the chain at operand ``pos`` as a per-channel step: ``(step, its
        operand's source or None)``; None when it is not one."""

    def channel(self, value, shape, axis: int) -> tuple[Any, Any] | None:
        """``value`` (broadcast to ``shape``) as a per-channel operand along ``axis``:
        ``(operand, its source)``; None when it varies along another axis."""

    def step(self, op, kind: str, operand, axis: int) -> Any:
        """A per-channel step of ``op`` with a resolved ``operand``."""

    def known(self, value) -> bool:
        """Whether ``value`` is known at transform time."""

    def is_activation(self, source, chain_value) -> bool:
        """Whether ``source`` is computed from the activations: a root's output, or a value
        ``chain_value`` is computed from (a statistic of the token)."""

    def consumers_refusal(self, value, top, axis: int) -> Reason | None:
        """None when the chain may take the op producing ``value``."""

    def n_consumers(self, value) -> int: ...

    invariant_memo: dict    # (value, axis, shape) -> bool, for :func:`invariant`


@dataclasses.dataclass
class ForwardChain:
    """A walked chain in front of a root; ``source``: the value before it (x)."""

    source: Any
    steps: list                 # per-channel steps, in program order
    tokens: list                # ("mul", r) / ("add", u) the root's input keeps, program order
    taken: list                 # the ops the chain took (steps, split products, shifts)
    stop: Reason | None         # why the walk stopped where an op could not be taken
    passes: list = dataclasses.field(default_factory=list)   # (ops the root's input goes
    # through again, program order: where the values live, not what they are)


def walk_forward(ir: ForwardIR, top, axis: int) -> ForwardChain | Reason:
    """Follow ``top`` (the root's input, features on ``axis``) back through the chain; a
    Reason when what was walked cannot fold (a lone per-token shift)."""
    v, steps, tokens, taken, stop, pending, passes = top, [], [], [], None, [], []
    while True:
        op = ir.producer(v)
        if op is None or not ir.takeable(op):
            break
        why = ir.consumers_refusal(v, top, axis)
        if why:
            stop = why
            break
        moved = ir.pass_axis(op, axis)
        if moved is not None:         # (the same values: the walk goes on before it)
            if pending or (moved != axis and (steps or tokens)):
                break                 # (the channels move only next to the root)
            passes.append(op)
            taken.append(op)
            v, axis = ir.operands(op)[0], moved
            continue
        ops = ir.operands(op)
        cands = []
        for pos, u in enumerate(ops):
            got = ir.affine(op, pos, axis) if ir.shape(u) is not None else None
            if got is not None and (got[1] is None or not ir.is_activation(got[1], u)):
                cands.append((pos, got[0], None, [], got[1]))
        if len(cands) > 1:        # a chain value is not known at transform time
            cands = [c for c in cands if not ir.known(ops[c[0]])]
        if len(cands) > 1:        # and is computed, where the operand is an input
            cands = [c for c in cands if ir.producer(ops[c[0]]) is not None
                     and c[4] is not None and ir.producer(c[4]) is None]
        shift = None
        if not cands and ir.kind(op) == "mul":
            cands = token_split(ir, op, axis)
        elif not cands and ir.kind(op) == "add" and not pending:
            shift = distributed_shift(ir, op, axis)
            cands = [] if shift is None else [shift[:4]]
        if len(cands) != 1:
            if len(cands) > 1:
                stop = AMBIGUOUS
            break
        pos, step, token, extra = cands[0][:4]
        if (tokens or pending) and step is not None and step.kind not in _SCALE_KINDS:
            break        # a shift before a per-token factor does not commute with it
        if step is not None:
            steps.append(step)
        if token is not None:
            tokens.append(("mul", token))
        tokens += [("add", u) for u in pending]
        pending = [] if shift is None else [shift[4]]
        taken += [op] + extra
        v = ops[pos]
    if pending:                 # the product the shift distributes over was not taken
        return LONE_SHIFT
    return ForwardChain(v, steps[::-1], tokens[::-1], taken, stop, passes[::-1])


def invariant(ir: ForwardIR, value, axis: int, shape) -> bool:
    """Whether ``value``, broadcast to ``shape``, is constant along ``axis`` (per token):
    a broadcast that does not fill ``axis``, or elementwise ops of such values. Walked with
    a worklist (no recursion, no depth bound), memoized in ``ir.invariant_memo``."""
    memo, shape = ir.invariant_memo, tuple(shape)
    if ir.shape(value) is None:
        return True                       # a literal

    def key(u):                           # literals (unhashable on a jaxpr) are invariant
        return None if ir.shape(u) is None else (u, axis, shape)

    top = key(value)
    stack = [(value, top, None)]      # (value, its key, its operands' keys once read)
    while stack:
        v, kv, keys = stack[-1]
        if kv in memo:
            stack.pop()
            continue
        if keys is None:
            here = _invariant_here(ir, v, axis, shape)
            if here is not None:
                memo[kv] = here
                stack.pop()
                continue
            keys = [key(u) for u in ir.operands(ir.producer(v))]   # (a shape query each)
            if any(k is not None and k in memo and not memo[k] for k in keys):
                memo[kv] = False     # an operand known to vary: the others need no walk
                stack.pop()
                continue
            missing = [(k[0], k, None) for k in keys if k is not None and k not in memo]
            if missing:
                stack[-1] = (v, kv, keys)
                stack.extend(missing)
                continue
        memo[kv] = all(k is None or memo[k] for k in keys)
        stack.pop()
    return memo[top]


def _invariant_here(ir: ForwardIR, value, axis: int, shape: tuple) -> bool | None:
    """:func:`invariant` of ``value`` where its own op decides; None: an elementwise op,
    invariant when its operands are."""
    s = ir.shape(value)
    if s is None:
        return True
    if len(s) == 0 or (len(s) == len(shape) and s[axis] == 1 and shape[axis] != 1):
        return True
    if tuple(s) != shape:
        return False
    op = ir.producer(value)
    if op is None:
        return False
    kind = ir.kind(op)
    if kind == "broadcast_in_dim":
        dims = tuple(ir.broadcast_dims(op))
        return axis not in dims or ir.shape(ir.operands(op)[0])[dims.index(axis)] == 1
    return None if kind in _ELEMENTWISE else False


def token_split(ir: ForwardIR, op, axis: int) -> list:
    """``mul(x, r)`` with ``r`` per token, or ``mul(x, r ⊗ γ)`` with ``γ`` per input channel:
    ``[(chain position, step or None, token, [the product's op])]``."""
    out = tuple(ir.shape(ir.result(op)))
    ops = ir.operands(op)
    found = []
    for pos in (0, 1):
        c, o = ops[pos], ops[1 - pos]
        cs = ir.shape(c)
        if cs is None or tuple(cs) != out or invariant(ir, c, axis, out):
            continue
        if invariant(ir, o, axis, out):
            found.append((pos, None, o, []))
            continue
        prod = ir.producer(o) if ir.shape(o) is not None else None
        if prod is None or ir.kind(prod) != "mul":
            continue
        oshape = tuple(ir.shape(o))
        for q in (0, 1):
            tok, ch = ir.operands(prod)[q], ir.operands(prod)[1 - q]
            if not invariant(ir, tok, axis, oshape):
                continue
            got = ir.channel(ch, oshape, axis)
            if got is None or ir.is_activation(got[1], c):
                continue
            found.append((pos, ir.step(op, "mul", got[0], axis), tok, [prod]))
            break
    return found


def distributed_shift(ir: ForwardIR, op, axis: int):
    """Keras's LayerNorm: ``x·P + (u·P + β)`` with ``P = r ⊗ γ`` and ``u = −μ`` per token
    is ``(x + u)·P + β``. Returns ``(position of x·P, step β or None, None, [ops computing
    u·P + β], u)``, or None."""
    out = tuple(ir.shape(ir.result(op)))
    ops = ir.operands(op)
    for pos in (0, 1):
        a, b = ops[pos], ops[1 - pos]
        pa = ir.producer(a) if ir.shape(a) is not None else None
        if pa is None or ir.kind(pa) != "mul":
            continue
        beta, dead = None, [b]
        b_op = ir.producer(b) if ir.shape(b) is not None else None
        if b_op is not None and ir.kind(b_op) == "add" and ir.n_consumers(b) == 1:
            for q in (0, 1):
                inner = ir.operands(b_op)
                got = ir.channel(inner[q], out, axis)
                if got is not None and not ir.is_activation(got[1], inner[1 - q]):
                    beta, b = ir.step(op, "add", got[0], axis), inner[1 - q]
                    dead.append(b)
                    break
        pb = ir.producer(b) if ir.shape(b) is not None else None
        if pb is None or ir.kind(pb) != "mul":
            continue
        a_ins, b_ins = list(ir.operands(pa)), list(ir.operands(pb))
        for P in [p for i, p in enumerate(a_ins) if p in b_ins and a_ins.index(p) == i]:
            u = b_ins[1 - b_ins.index(P)]
            if ir.shape(P) is not None and invariant(ir, u, axis, out) and \
                    a_ins.count(P) == 1 and b_ins.count(P) == 1:
                return (pos, beta, None, [ir.producer(d) for d in dead], u)
    return None

