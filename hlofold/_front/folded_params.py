"""What :func:`hlofold.fold_params` returns: the folded tree, each site written back (which
leaves changed, what they were and which role each played), and the report."""
from __future__ import annotations

import dataclasses
from typing import Any

from hlofold._base.report import REFUSED, FoldReport, FoldSite


@dataclasses.dataclass
class ParamChange:
    """One site written back: which leaves (pytree paths) changed, and how."""

    site: FoldSite
    kernel: str                  # the rescaled kernel
    bias: str | None             # the leaf that carries the folded shift t, if any
    identity: list[str]          # leaves set to an identity (γ → 1, σ² → 1 − ε, μ, β → 0)
    # what the site absorbed, as it was: path -> the original value of each identity leaf
    # and of the bias slot (a BN's γ, β, μ, σ²; a norm's γ) — for a quantizer's own pass
    # (high-bias absorption reads β and γ); top-level sites (a stack's are per layer)
    absorbed: dict = dataclasses.field(default_factory=dict)
    # what each absorbed leaf was (path -> "scale" γ, "shift" β, "mean" μ, "variance" σ²),
    # read from the computation the model does with it, and the ε added to σ² (a BN's)
    roles: dict = dataclasses.field(default_factory=dict)
    epsilon: float | None = None
    # where no bias of the layer can carry the shift in front of it (a norm's β before a
    # bias-free layer, a BN's shift before a padded convolution): the leaf that keeps it
    # there as t/s (β/γ), the front's scales identities and s in the kernel
    front: str | None = None


@dataclasses.dataclass
class FoldedParams:
    """What :func:`fold_params` returns."""

    params: Any                  # the same pytree, folded
    changes: list[ParamChange]
    report: FoldReport           # every site; folded ones not written back are REFUSED
    # equalize=True: the layer pairs equalized, and the layers left with the reason (and
    # its kind); smooth=: the same for smoothing
    equalized: list = dataclasses.field(default_factory=list)
    not_equalized: list = dataclasses.field(default_factory=list)
    smoothed: list = dataclasses.field(default_factory=list)
    not_smoothed: list = dataclasses.field(default_factory=list)
    rotation: Any = None         # rotate=True: what was rotated, or why not

    def __str__(self) -> str:
        lines = [f"hlofold.fold_params: {len(self.changes)} site(s) written back"]
        for c in self.changes:
            where = f"{c.site.file}:{c.site.line}" if c.site.file else c.site.scope
            lines.append(f"  {c.site.pattern:12s} {where}: kernel {c.kernel}; "
                         f"bias {c.bias or '-'}; identity {', '.join(c.identity) or '-'}" +
                         (f"; {c.front} kept in front as t/s" if c.front else ""))
        kept = [s for s in self.report.sites if s.status == REFUSED and
                (s.reason or "").startswith(NOT_WRITTEN)]
        for s in kept:
            lines.append(f"  not written back ({s.file}:{s.line}): {s.reason}")
        for e in self.equalized + self.smoothed:
            lines.append(f"  {e.kind} {e.first} -> {', '.join(e.seconds)} ({e.location}): "
                         f"{e.alpha_words()}scales {e.scale_range[0]:.3g}-"
                         f"{e.scale_range[1]:.3g}; channel "
                         f"spread {e.spread_before[0]:.3g} -> {e.spread_after[0]:.3g}, "
                         f"{e.spread_before[1]:.3g} -> {e.spread_after[1]:.3g}" +
                         (f"; a residual stream, written by {', '.join(e.writers)} too"
                          if e.writers else "") +
                         ("; scales powers of two (low-precision weights: exact)"
                          if e.powers_of_two else "") + e.unsettled())
        for what, left in (("equalized", self.not_equalized),
                           ("smoothed", self.not_smoothed)):
            for e in left:
                lines.append(f"  not {what} {e.kernel} ({e.location}; {e.kind}): {e.reason}")
        if self.rotation is not None:
            lines.append(f"  {self.rotation}")
        return "\n".join(lines)


NOT_WRITTEN = "not written back: "
