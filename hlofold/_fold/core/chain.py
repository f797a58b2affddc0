"""The chain after a root, walked once for both IR adapters.

A *chain* is the run of ops after a root (a convolution or a dot) along which the value stays
a per-channel affine image ``y·s + t`` of the root's output, passed through shape ops and
float casts. :func:`walk` is the one walk of both paths. An IR adapter (:class:`ChainIR`:
``_fold.jaxpr.plan.JaxprChain`` on a jaxpr, ``_fold.stablehlo.match.HloChain`` on StableHLO) says who reads
a value and what one op does to the chain, through its per-op rule table; the rules that
decide are here, once:

* a chain value has exactly one reader (else the site is refused: folding would change the
  other readers — where one of them could take the chain on; readers none of which is a
  per-channel affine op only end it); a program output ends the chain;
* an absorbed operand is not computed from an activation (a residual, a gate); an op
  whose other operand is an activation and that cannot be absorbed ends the chain without
  refusing it (nothing per-channel was there to fold);
* a refusal about an axis of the root's output says what that axis is;
* a cast to a narrower float type ends the chain (``_fold.core.rules.narrowing_cast``): it
  rounds, so what follows is not an affine image of the root's output — unless nothing was
  absorbed yet and it returns to a type that holds every value the chain has had;
* the chain is cut after its last absorbed affine op (trailing shape ops stay).

:func:`chain_kind` reads a walked chain: nothing to fold, already a canonical bias, or a
fold. :func:`postorder` is the memoized walk over producers both adapters use to say
whether a value is computed from an activation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterable, Protocol

from hlofold._base.chain_rules import Refusal
from hlofold._base.reasons import Reason
from .rules import narrowing_cast

# Refusals and notes both paths write, in the same words.
FROM_ACTIVATION = Reason("operand-from-activation", "operand is computed from a convolution "
                         "output (a residual or a gate), not from parameters")
KERNEL_FROM_ACTIVATION = Reason("kernel-from-activation", "the kernel (rhs) is computed from a "
                                "convolution/dot output (an activation, e.g. attention), not "
                                "from parameters")
JOINS_ACTIVATION = Reason("chain-end", "the chain ends where it meets another activation (a "
                          "residual, a gate, a product of activations): nothing per-channel "
                          "to fold there")
CANONICAL_BIAS = Reason("canonical", "already conv + per-channel bias")
UNUSED = Reason("chain-end", "value is unused")

_MAX_STEPS = 100_000          # a chain is never longer than its program


@dataclasses.dataclass(frozen=True)
class Absorb:
    """An affine op taken into ``y·s + t``; ``source``: its operand's source (checked: not an
    activation), None for an op without one (neg)."""

    step: Any
    source: Any = None


@dataclasses.dataclass(frozen=True)
class Pass:
    """An op the chain passes through, the channel now on ``axis``; ``cast``: ``(from, to)``
    float dtypes when the op is a cast."""

    step: Any
    axis: int
    cast: tuple | None = None


AGAIN = object()     # the adapter changed who reads the value (a call inlined): look again


class ChainIR(Protocol):
    """What :func:`walk` needs of an IR (one root at a time)."""

    program: str            # for "value is an output of the <program>"

    def uses(self, value) -> tuple[list[tuple[Any, int]], int]:
        """The ops that read ``value`` (op, operand position) and how often the program
        returns it."""

    def name(self, op) -> str:
        """The op's name, as reasons write it."""

    def result(self, op) -> Any:
        """The op's (only) result: the next chain value."""

    def describe(self, value) -> str:
        """The value's type, as reasons write it."""

    def step(self, op, pos: int, value, axis: int) -> "Absorb | Pass | Refusal | str | object":
        """What ``op`` (reading ``value`` at operand ``pos``) does to the chain: absorbed,
        passed, refused (a Refusal), the chain's end (a str: why), or :data:`AGAIN`."""

    def peek(self, op, pos: int, value, axis: int) -> "Absorb | Pass | Refusal | str | None":
        """What :meth:`step` would say, changing nothing (None: it would have to change the
        program to tell, e.g. inline a call)."""

    def from_root(self, value) -> bool:
        """Whether ``value`` is computed from a root's output (an activation)."""

    def joins_activation(self, op, pos: int, value) -> bool:
        """Whether ``op`` combines ``value`` (its operand ``pos``) with another activation:
        computed from a root's output or from the inputs ``value`` is computed from."""

    def explain_axis(self, axis: int) -> str:
        """What axis ``axis`` of the root's output is (batch, spatial, feature)."""


@dataclasses.dataclass
class Walked:
    """A walked chain: ``steps`` up to the last absorbed op, the channel axis there, why the
    walk stopped and whether that stop refuses the site."""

    steps: list
    axis: int
    stop: str | None
    refusal: bool


def walk(ir: ChainIR, root_value, axis: int) -> Walked:
    """Follow ``root_value`` (a root's output, channel on ``axis``) through its chain."""
    v = root_value
    steps: list = []
    committed, committed_axis = 0, axis
    stop, refusal = None, False
    narrowest = None              # the narrowest float type of the value since the root
    for _ in range(_MAX_STEPS):
        users, n_out = ir.uses(v)
        n = len(users) + n_out
        if n == 0:
            stop = UNUSED
            break
        if n > 1:
            who = [ir.name(op) for op, _ in users] + ["output"] * n_out
            what = "the conv output" if v == root_value else \
                f"value {ir.describe(v)} in the chain"
            refusal = bool(steps) or any(_may_absorb(ir, op, pos, v, axis)
                                         for op, pos in users)
            stop = Reason("consumers", f"{what} has {n} consumers ({', '.join(who)}); "
                          "folding would change them") if refusal else \
                Reason("chain-end", f"{what} has {n} consumers ({', '.join(who)}), none of "
                       "them a per-channel affine op: nothing to fold")
            break
        if n_out:
            stop = Reason("chain-end", f"value is an output of the {ir.program}")
            break
        op, pos = users[0]
        got = ir.step(op, pos, v, axis)
        if got is AGAIN:
            continue
        if isinstance(got, Refusal) and got.kind == "feature-axis" and \
                ir.joins_activation(op, pos, v):
            stop = JOINS_ACTIVATION.after(f"{ir.name(op)}: ")    # not a refusal: nothing
            break                                              # to fold was there
        if isinstance(got, Refusal):
            stop, refusal = got.reason, True
            if got.axis is not None and (v == root_value):
                stop = stop.then(f"; axis {got.axis} is {ir.explain_axis(got.axis)}")
            break
        if isinstance(got, str):        # the chain ends here (a str: why)
            stop = got if isinstance(got, Reason) else Reason("chain-end", got)
            break
        if isinstance(got, Absorb):
            if got.source is not None and ir.from_root(got.source):
                stop = FROM_ACTIVATION.after(f"{ir.name(op)}: ")   # a gate: the chain's
                break                                              # end, not a refusal
            steps.append(got.step)
            committed, committed_axis = len(steps), axis
        else:
            if got.cast is not None:
                src, dst = got.cast
                narrowest = src if narrowest is None else narrowest
                why = narrowing_cast(src, dst, None if committed else narrowest)
                if why:
                    stop = why
                    break
                narrowest = dst if narrowing_cast(narrowest, dst) else narrowest
            steps.append(got.step)
            axis = got.axis
        v = ir.result(op)
    return Walked(steps[:committed], committed_axis, stop, refusal)


def _may_absorb(ir: ChainIR, op, pos: int, v, axis: int, depth: int = 8) -> bool:
    """Whether ``op`` could take the chain on (an affine op with a per-channel operand from
    the parameters, or one the chain passes that such an op reads after): then a value read
    by several ops is a site refused, else only the chain's end."""
    got = ir.peek(op, pos, v, axis)
    if isinstance(got, Absorb) and got.source is None:       # a negation: no fold alone
        got = Pass(got.step, axis)                           # (sigmoid's negate, exp, ...)
    if got is None or (isinstance(got, Pass) and depth == 0):
        return True
    if isinstance(got, Pass):
        r = ir.result(op)
        return any(_may_absorb(ir, o, p, r, got.axis, depth - 1) for o, p in ir.uses(r)[0])
    if isinstance(got, Absorb):
        return not ir.from_root(got.source)
    if isinstance(got, Refusal):
        return got.kind != "feature-axis"
    return False


def affine_after(ir: ChainIR, root_value, ndim: int) -> bool:
    """Whether a root that cannot be read (a dot with several output dimensions, an integer
    kernel) has an affine op after it along any of its ``ndim`` axes: then its site is
    refused, else there was nothing to fold (``no-pattern``), the same on both paths."""
    for axis in range(ndim):
        w = walk(ir, root_value, axis)
        if w.steps or (w.refusal and getattr(w.stop, "kind", None) == "consumers"):
            return True
    return False


def chain_kind(affine_kinds: Iterable[str]) -> str:
    """``"none"`` (no affine op absorbed), ``"canonical"`` (one add or sub: already conv plus
    a bias, nothing to fold) or ``"fold"``. A negation counts for nothing: folded it would
    only move a sign XLA fuses into the next op anyway (JAX lowers ``sigmoid`` to
    ``negate, exponential, …``: the StableHLO path would fold the negate the jaxpr's
    ``logistic`` hides, and the two paths would count the site differently)."""
    kinds = [k for k in affine_kinds if k != "neg"]
    if not kinds:
        return "none"
    if len(kinds) == 1 and kinds[0] in ("add", "sub"):
        return "canonical"
    return "fold"


def postorder(top: Hashable, memo: dict, inputs_of: Callable[[Any], list],
              settle: Callable[[Any], None]):
    """``memo[top]``, computing first every input it needs (depth first, iterative:
    programs can be deeper than Python's stack): ``inputs_of(n)`` the nodes ``n`` reads,
    ``settle(n)`` stores ``n``'s value in ``memo`` once its inputs' are there (it may store
    other nodes' too, e.g. every output of one equation)."""
    stack = [top]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        missing = [u for u in inputs_of(n) if u not in memo]
        if missing:
            stack.extend(missing)
            continue
        settle(n)
        stack.pop()
    return memo[top]
