"""Reasons and their kinds, one table for both IR paths.

A reason is written where it is found, in words a user can act on (naming the op and axis).
Its *kind* says which rule wrote it, so that the jaxpr and the StableHLO path can be compared
site by site (``tests/parity/test_differential.py``) and reports can be grouped. A :class:`Reason`
is the words (it is a ``str``) carrying its kind; the kind is set by the rule that writes the
reason, never read back from the words.
"""
from __future__ import annotations

# kind -> which rule writes it
KINDS: dict[str, str] = {
    "not-finite": "the folded scale is not finite (σ² = 0 with ε = 0, an inf γ)",
    "overflow": "the rescaled kernel overflows its dtype",
    "underflow": "the rescaled kernel underflows a whole output channel",
    "precision": "the chain computes in a wider float type than the kernel",
    "subnormal": "a value known now depends on subnormal numbers, which backends flush",
    "unchecked-range": "a narrow kernel would be rescaled in the graph, unchecked",
    "weights-not-known": "the weights are known only at run time, and in-graph folding is off",
    "kernel-from-activation": "the kernel is computed from an activation",
    "operand-from-activation": "an absorbed operand is computed from an activation",
    "consumers": "a chain value has other readers",
    "feature-axis": "an operand or a shape op does not keep the output-feature axis",
    "not-affine": "the chain value is a divisor",
    "not-float": "a value or a cast is not a float",
    "bias-map": "a shift in front of a padded convolution",
    "cost": "hlofold.fold's cost rule: the fold removes no pass, and costs memory or work",
    "root": "the root itself cannot be folded (integer, grouping, dot layout)",
    "symbolic": "symbolic shapes",
    "chain-end": "the chain ends (an op it does not take, an output, an unused value)",
    "narrowing": "a cast to a narrower float type rounds the chain value",
    "canonical": "already conv + bias",
    "unreached": "a per-channel scale no root reaches",
    "not-written": "fold_params cannot write the fold back",
    "branches": "parallel branches that cannot merge into one convolution",
    "stack-layers-differ": "the layers of a scanned stack do not fold alike",
    "internal": "hlofold failed to rewrite the program",
    # the quantization rewrites' (equalize, smooth, rotate: hlofold._quant)
    "pair-path": "a rewrite's channels meet an op that does not pass its scales exactly",
    "pair-readers": "a layer's output is read by more than the next layers",
    "pair-output": "a layer's output is a program output, or unread, before another layer",
    "pair-second": "the next layer cannot take the scales (other channels, a shared kernel)",
    "pair-start": "the first layer's kernel is not a weight the rewrite may scale",
    "pair-not-float": "a weight of the pair is not floating point",
    "pair-loop": "layers inside a loop or body the rewrite does not read",
    "pair-stream": "a layer's output joins a residual stream that cannot be scaled as one",
    "rotation": "the residual stream cannot be rotated exactly",
}


class Reason(str):
    """Words a user can act on (the string itself) and :attr:`kind`, the rule that wrote
    them (a key of :data:`KINDS`). String operations give plain strings: extend one with
    :meth:`then` or :meth:`after` to keep its kind."""

    kind: str

    def __new__(cls, kind: str, text: str) -> "Reason":
        if kind not in KINDS:
            raise ValueError(f"unknown reason kind {kind!r}")
        r = super().__new__(cls, text)
        r.kind = kind
        return r

    def __reduce__(self):
        return Reason, (self.kind, str(self))

    def then(self, more: str) -> "Reason":
        return Reason(self.kind, str(self) + more)

    def after(self, prefix: str) -> "Reason":
        return Reason(self.kind, prefix + str(self))


def kinded(kind: str, reason: str) -> "Reason":
    """``reason`` with ``kind`` where it has none yet (a kind a rule set is kept)."""
    return reason if isinstance(reason, Reason) else Reason(kind, reason)


def reason_kind(reason: str | None) -> str | None:
    """The kind of a reason (None for no reason; ``"other"`` for words without a kind)."""
    if reason is None:
        return None
    return getattr(reason, "kind", "other")
