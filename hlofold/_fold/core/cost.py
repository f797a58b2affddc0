"""The cost rule of :func:`hlofold.fold`: fold a site where the per-call program gets cheaper.

A fold pays per call where it removes a **pass over a tensor**:

* a per-channel scale between a root and its consumers: after the fold the root ends in a
  bias add, which convolution and GEMM kernels take as their epilogue (cuDNN, cuBLASLt,
  oneDNN), where a scale between them is a pass of its own on GPUs;
* an affine pass of its own in front of a root (an input standardization before the stem,
  read from an input or a root's output, not computed in the loop of the op producing it).

A fold that removes no pass removes only multiplies inside a pass that stays — LayerNorm's
and RMSNorm's γ next to the per-token factor ``x·r``, which the folded program still
computes, or an affine in front computed in one loop with the op producing its input — and
under ``hlofold.fold`` it costs: a folded copy of the kernel held beside the user's
parameters (prepared), or the kernel rescaled on every call (in the graph). Such a site is
*left*, with its figures (:class:`SiteCost`), not refused: ``hlofold.fold(f,
fold_costly=True)`` folds it anyway. Constants (``freeze=``), :func:`hlofold.fold_params`
(which rewrites the user's own weights), :func:`hlofold.fold_jaxpr` and
:func:`hlofold.fold_stablehlo` fold what is safe and do not apply the rule.
"""
from __future__ import annotations

import dataclasses

from hlofold._base.reasons import Reason


@dataclasses.dataclass(frozen=True)
class SiteCost:
    """A site's figures: what its fold changes per call and in memory."""

    passes_removed: int      # passes over a tensor the fold removes
    ops_removed: int         # elementwise multiplies/adds per call the fold removes
    held_bytes: int          # folded copies kept beside the parameters (prepared)
    rescaled: int            # kernel elements rescaled per call (in the graph)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cost_refusal(cost: SiteCost, why_no_pass: str) -> Reason | None:
    """None where the fold pays (it removes a pass), else why the site is left, with its
    figures (``why_no_pass``: what keeps the pass, in the adapter's words)."""
    if cost.passes_removed > 0:
        return None
    spends = []
    if cost.held_bytes:
        spends.append(f"hold a {cost.held_bytes / 2 ** 20:.3g} MB folded copy of the kernel "
                      "beside the parameters")
    if cost.rescaled:
        spends.append(f"rescale {cost.rescaled} kernel elements on every call")
    return Reason("cost", f"left for cost: the fold removes no pass over a tensor "
                  f"({why_no_pass}), only {cost.ops_removed} elementwise ops per call, and "
                  f"would {' and '.join(spends) or 'gain nothing'}; "
                  "hlofold.fold(..., fold_costly=True) folds it anyway")
