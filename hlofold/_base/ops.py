"""What an op means, stated once: the fact sheet every walk reads.

Each IR keeps one registry, an entry per primitive or op name (``hlofold._ir.jaxpr.ops``,
``hlofold._ir.stablehlo.ops``), as JAX keeps one table per rule keyed by primitive. The walks —
the fold chain after a root, the forward walk in front of one, the merge reader, the calls a
fold crosses, the pair walk and the stream walks of the quantization rewrites — ask these facts
instead of keeping op lists of their own; their *rules* (what to do at an op of a kind) stay
with them, keyed by the kinds below. An op the registry does not know has no facts: every walk
stops there.

The facts, each true of the op whatever its operands unless said otherwise:

* ``layer``: ``"conv"`` or ``"dot"`` — a layer: a fold's root, a pair's ends.
* ``affine``: ``"add"``, ``"sub"``, ``"mul"``, ``"div"``, ``"neg"`` or ``"bn"`` (an inference
  BatchNorm in one op) — a step of the per-channel affine chain ``y·s + t``.
* ``shape``: the values as they are, only their positions moved (the channel axis found by
  shape): ``"cast"`` (a float convert; see ``rounding``), ``"reshape"``, ``"squeeze"``,
  ``"expand"``, ``"broadcast"``, ``"dynamic_broadcast"``, ``"transpose"``, ``"copy"``,
  ``"constraint"`` (a sharding constraint: where the values live).
* ``rounding``: ``"always"`` — it rounds its values (``reduce_precision``), or
  ``"narrowing"`` — it rounds when its result has fewer mantissa bits than its operand (a
  convert). Across a rounding only power-of-two scales pass exactly, and no rotation does.
* ``elementwise``: each result element comes from the same element of each operand (so a value
  constant along an axis stays so).
* ``homogeneous``: ``True`` — ``f(s·x) = s·f(x)`` for every ``s > 0``; ``False`` — not for some
  values (``tanh``, ``min(x, 6)``, ``x²``); ``None`` — it depends on the other operands, a walk's
  rule decides (``max(x, 0)``, ``pad``).
* ``activation``: an elementwise nonlinearity networks apply as an activation (a merge of
  branches stops there).
* ``exponent``: a fixed power of its operand (``rsqrt``: −½, ``sqrt``: ½, ``square``: 2).
* ``call``: ``"jit"``, ``"custom"`` (custom_jvp/vjp) or ``"remat"`` — a call whose body the
  walks enter.
* ``opaque``: computed in a pass of its own (a layer, a loop, a branch, a custom call, a sort):
  XLA fuses no elementwise consumer into it.
* ``branches``: a conditional whose regions are its branches (``case``, ``if``).
* ``selects``: it picks a part of its operand (``slice``, ``dynamic_slice``): a stack's row.
* ``pure``: known to have no effect but its results: erased where they are unused.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class Op:
    """The facts of one op (see the module's docstring). Checked at creation: a layer, an
    affine step and a shape op are three different things."""

    layer: str | None = None
    affine: str | None = None
    shape: str | None = None
    rounding: str | None = None
    elementwise: bool = False
    homogeneous: bool | None = None
    activation: bool = False
    exponent: float | None = None
    call: str | None = None
    opaque: bool = False
    branches: bool = False
    selects: bool = False
    pure: bool = False

    def __post_init__(self):
        checks = [(self.layer, ("conv", "dot")),
                  (self.affine, ("add", "sub", "mul", "div", "neg", "bn")),
                  (self.shape, ("cast", "reshape", "squeeze", "expand", "broadcast",
                                "dynamic_broadcast", "transpose", "copy", "constraint")),
                  (self.rounding, ("always", "narrowing")),
                  (self.call, ("jit", "custom", "remat"))]
        for value, allowed in checks:
            if value is not None and value not in allowed:
                raise ValueError(f"unknown op fact {value!r} (one of {allowed})")
        if sum(x is not None for x in (self.layer, self.affine, self.shape)) > 1:
            raise ValueError("an op is a layer, an affine step or a shape op, not several")


NONE = Op()


class Registry(Mapping):
    """One IR's ops: name → :class:`Op`. Unknown names read as :data:`NONE` (no facts)."""

    def __init__(self, ir: str, entries: Mapping[str, Op]):
        self.ir = ir
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> Op:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def of(self, name: str) -> Op:
        """The facts of ``name`` (:data:`NONE` for an op the registry does not know)."""
        return self._entries.get(name, NONE)

    def names(self, where: Callable[[Op], bool]) -> frozenset[str]:
        """The ops whose facts satisfy ``where``."""
        return frozenset(n for n, op in self._entries.items() if where(op))

    def kinds(self, fact: str, mapping: Mapping[str, str] | None = None) -> dict[str, str]:
        """``{name: its value of fact}`` for the ops that have one (renamed by ``mapping``
        where given; values missing from it are left out)."""
        out = {}
        for n, op in self._entries.items():
            v = getattr(op, fact)
            if v is None or v is False:
                continue
            if mapping is not None:
                if v not in mapping:
                    continue
                v = mapping[v]
            out[n] = v
        return out
