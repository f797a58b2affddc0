"""The pair walk of cross-layer equalization and smoothing, written once for both IR adapters.

A pair (:class:`.equalize.Pair`) starts at a layer whose kernel is a weight the rewrite may
scale and follows the layer's output channel, op by op, to the next layers that read it as
their activations. Each adapter reads its IR into a :class:`PathIR` (who reads a value, what
a layer is, its own per-op rules of the path: how the channel axis moves through an op, or
why the path stops there); the rules of the walk are here, once:

* every value on the path is read once — a residual add, a second reader, would see the
  scaled channels — unless every reader is a layer (q, k and v; gate and up: one pair with
  several second layers);
* LeakyReLU's three readers (the comparison with 0, the product by the slope, the select)
  pass the channels as one;
* a rounding op (``reduce_precision``) passes, and marks the pair *low*: only powers of two
  cross it exactly (:func:`.equalize.powers_of_two`);
* a dot of two activations contracting none of the channels (attention's ``probs @ v``)
  moves them to its output;
* a channel repeated over an axis (:class:`~hlofold._base.channel_axes.Mapped`, grouped-query
  attention's ``repeat``) passes only the ops that keep repeats; elsewhere it must settle;
* a layer reading the channels is a second layer (:func:`second_layer`) when it contracts
  exactly them and its kernel is a weight read once.

:func:`find_pairs` forms the pairs of one program level; :func:`through_body` follows the
channels through a called function's body to its return (the adapters' call rules).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from hlofold._base.chain_rules import Refusal
from hlofold._base.reasons import Reason, kinded
from hlofold._base.channel_axes import REPEATED, Mapped, settled
from .equalize import Pair, stops_here

_MAX_STEPS = 10_000       # a path is never longer than its program


@dataclasses.dataclass
class Found:
    """A pair, the op it starts at, and the value its second layers read (its channel
    axis): what calibration measures for smoothing. ``low``: a value from the first layer's
    output to the second layers' input is of a low-precision float or rounded (then its
    scales are powers of two). A norm site's start may be the value itself (no op)."""

    pair: Pair
    at: Any
    end: Any = None
    end_axis: Any = 0
    low: bool = False


@dataclasses.dataclass
class Refused:
    """A first layer whose pair was not formed: its kernel's key (None where it has none),
    the op, why, and where (a scanned stack's name, for people)."""

    key: str | None
    at: Any
    reason: str
    where: str = ""


@dataclasses.dataclass(frozen=True)
class Start:
    """A layer a pair may start at: its kernel (the adapter's handle, keyed by
    :meth:`PathIR.key` once the path is read), the output's channel axis and the kernel's
    output axis (tuples of axes for a multi-head kernel); ``offset``: a norm's scale read as
    ``kernel + offset`` (``x·(1 + γ)``)."""

    kernel: Any
    axis: Any
    out_axis: Any
    offset: float = 0.0


class PathIR(Protocol):
    """What the walk needs of an IR, with the biases a pair scales collected as it goes."""

    outputs: str                 # what the program's outputs are, in the reasons
    biases: list                 # (key, axis) of the pair being read (the rules fill it)

    def readers(self, v) -> list:
        """``[(op, operand position)]`` reading ``v``; ``(None, -1)`` for the return."""

    def name(self, op) -> str:
        """The op's name, for the reasons and the rule tables."""

    def result(self, op):
        """The op's first result."""

    def low(self, v) -> bool:
        """Whether ``v`` is of a float type too narrow for scales other than powers of two."""

    def leaky(self, three: list):
        """The select's result where three uses are LeakyReLU's, else None."""

    def is_layer(self, op) -> bool:
        """Whether ``op`` is a convolution or a dot."""

    def rounds(self, op) -> bool:
        """Whether ``op`` rounds its values (``reduce_precision``)."""

    def rule(self, op) -> Callable | None:
        """The adapter's per-op rule of the path, ``rule(op, pos, axis)`` -> the channel
        axis of the result or why the path stops; None where the op has none."""

    def keeps_mapped(self, op) -> bool:
        """Whether ``op``'s rule passes a channel repeated over an axis."""

    def not_homogeneous(self, op) -> bool:
        """Whether the op is known not to commute with a positive scale (for the reason)."""

    def through_dot(self, op, pos: int, axis):
        """The channel axis of a dot of two activations contracting none of the channels,
        else None."""

    def input_channel(self, op, pos: int):
        """``(activation axis, kernel input axis)`` of the layer ``op`` reading operand
        ``pos``, or a :class:`Refusal`."""

    def second_kernel(self, op, pos: int, in_axis: int):
        """The :class:`Second` the layer ``op`` is (its kernel, the other operand, a weight
        read once), or why not."""

    def second_over_axes(self, op, pos: int, axis):
        """A dot reading channels split over axes, contracting exactly those: a
        :class:`Second`, or why not."""

    def start(self, op) -> Start | tuple | None:
        """The :class:`Start` of a layer whose kernel is a weight read once; ``(why, key)``
        for one whose kernel is shared; None for no start."""

    def key(self, kernel) -> str:
        """The key of a kernel (a weight) in the rewrite's values."""

    def bias_keys(self) -> list:
        """:attr:`biases` as ``(key, axis)`` of the rewrite's values."""


def step(g: PathIR, op, pos: int, axis, where: str):
    """What one op on the path does to the channels on ``axis``: the axis of its result, or
    why the path stops there (``where``: "on the way", "(inside …)")."""
    rule = g.rule(op)
    if isinstance(axis, Mapped) and not g.keeps_mapped(op):
        axis = settled(axis)
        if isinstance(axis, Mapped):
            return REPEATED.format(op=g.name(op))
    if rule is None:
        return stops_here(g.name(op), g.not_homogeneous(op), where)
    return rule(op, pos, axis)


def second_layer(g: PathIR, op, pos: int, axis):
    """The layer ``op`` reading the channels (``axis``) at operand ``pos`` as a
    :class:`Second` — its kernel a weight read once, contracting the channels — or why not."""
    if not g.is_layer(op):
        return Reason("pair-readers", f"{g.name(op)} reads it besides the layers")
    if isinstance(axis, Mapped):      # (a repeat the layer contracts; else copies it keeps)
        got, plain = g.second_over_axes(op, pos, axis), settled(axis)
        return second_layer(g, op, pos, plain) if isinstance(got, str) and \
            not isinstance(plain, Mapped) else _second(got)
    if isinstance(axis, tuple):
        return _second(g.second_over_axes(op, pos, axis))
    ch = g.input_channel(op, pos)
    if isinstance(ch, Refusal):
        return Reason("pair-second", f"the next {g.name(op)}: {ch.reason}")
    act_axis, in_axis = ch
    if act_axis != axis:
        return Reason("pair-second", f"the next {g.name(op)} does not contract the channel "
                                     f"axis")
    return _second(g.second_kernel(op, pos, in_axis))


def _second(got):
    """A second layer, or why not (of kind ``pair-second`` where the rule set none)."""
    return kinded("pair-second", got) if isinstance(got, str) else got


def follow(g: PathIR, v, axis):
    """From the first layer's output ``v`` (channel ``axis``) to the layers that read it:
    ``([Second], the value they read, its channel axis, whether a value on the way is of a
    low-precision float or rounded)``, or why not."""
    low = False
    for _ in range(_MAX_STEPS):
        low = low or g.low(v)
        u = g.readers(v)
        if any(op is None for op, _ in u):
            return Reason("pair-output", f"its output is {g.outputs} before another layer "
                                         f"reads it")
        if len(u) == 3 and (out := g.leaky(u)) is not None:
            v = out                               # (the channel axis stays)
            continue
        if len(u) > 1:
            seconds = [second_layer(g, op, pos, axis) for op, pos in u]
            if all(not isinstance(x, str) for x in seconds):
                return seconds, v, axis, low      # (q, k and v; gate and up)
            return Reason("pair-readers", f"its output is read {len(u)} times, not only by "
                          f"layers (a residual or another reader would see the scaled "
                          f"channels)")
        if not u:
            return Reason("pair-output", "its output is not read")
        op, pos = u[0]
        if g.is_layer(op):
            got = second_layer(g, op, pos, axis)
            if not isinstance(got, str):
                return [got], v, axis, low
            through = g.through_dot(op, pos, axis)
            if through is None:
                return got
            v, axis = g.result(op), through
            continue
        if g.rounds(op):         # (it rounds: only powers of two pass exactly)
            low, v = True, g.result(op)
            continue
        got = step(g, op, pos, axis, "on the way")
        if isinstance(got, str):
            return got
        v, axis = g.result(op), got
    return "the path is too long"


def through_body(g: PathIR, v, axis, what: str, where: str):
    """From a called function's argument ``v`` (channel ``axis``) to its return: the
    channel axis there, or why not (``what``: the call, ``where``: "(inside …)", for the
    reasons)."""
    for _ in range(_MAX_STEPS):
        u = g.readers(v)
        if len(u) == 3 and (out := g.leaky(u)) is not None:
            v = out
            continue
        if len(u) != 1:
            return f"inside {what}: the channels are read {len(u)} times"
        op, pos = u[0]
        if op is None:
            return axis
        got = step(g, op, pos, axis, where)
        if isinstance(got, str):
            return got
        v, axis = g.result(op), got
    return "the path is too long"


def find_pairs(g: PathIR, ops) -> tuple[list[Found], list[Refused]]:
    """Every pair starting at one of ``ops`` (a program level, in order) and the starts
    refused. Second layers claimed by an earlier pair are not paired again."""
    found, refused, claimed = [], [], set()
    for op in ops:
        start = g.start(op)
        if start is None:
            continue
        if not isinstance(start, Start):
            refused.append(Refused(start[1], op, kinded("pair-start", start[0])))
            continue
        g.biases = []
        got = follow(g, g.result(op), start.axis)
        k1 = g.key(start.kernel)
        if isinstance(got, str):      # (an op's rule of the path: of kind "pair-path")
            refused.append(Refused(k1, op, kinded("pair-path", got)))
            continue
        seconds, end, end_axis, low = got
        if any(sec.key in claimed for sec in seconds):
            continue
        claimed.update(sec.key for sec in seconds)
        found.append(Found(Pair(k1, start.out_axis, seconds, g.bias_keys(),
                                offset=start.offset), op, end, end_axis, low))
    return found, refused
