"""The procedure of one site, written once for both IR adapters.

A *site* is a root (a convolution or a dot) with the chain after it and the chain before it.
:func:`plan_site` is the one procedure of both paths; an IR adapter (:class:`SiteIR`:
``_fold.jaxpr.plan`` over a jaxpr scope, ``_fold.stablehlo.fold`` over a module pass) reads
the root and writes what was decided. The steps, in order:

1. the root's readings (:class:`~.patterns.RootInfo`: the kernel on the rhs, then on the lhs
   of a dot — Equinox's ``W @ x``); none: the site is "no pattern", or refused where an affine
   op follows it all the same;
2. the adapter's own refusal of the root (a StableHLO root of integers);
3. the first reading whose chain folds (``_fold.core.chain.walk``), else the first one walked
   whose kernel is not an activation (Gemma's ``einsum("BTD,SNDH->SBTNH", x, W)``: the
   weight is the lhs; the forward fold needs it), else the first; a reading other than the
   first is tried only where the first's kernel is no weight, and only for a kernel known
   now or shaped as a weight (an input on the lhs may as well be the activations);
4. the chain's status (``_fold.core.decide.chain_status``); its ops claimed (no other root
   takes them);
5. the forward fold before the root (the adapter's forward planner; recorded there);
6. a chain that does not fold is recorded — canonical (already ``conv + bias``) or refused, but
   not "unused" where a forward fold goes on — and the site ends unless a forward fold goes on
   (a canonical bias then merges into its bias; no affine op: nothing after the root);
7. the adapter folds: values now (float64), the decision (``_fold.core.decide.decide``), the
   rewrite.
"""
from __future__ import annotations

from typing import Any, Protocol

from hlofold._base.report import CANONICAL, FOLDED, REFUSED
from .chain import UNUSED, Walked, chain_kind
from .decide import chain_status
from .patterns import RootInfo


class SiteIR(Protocol):
    """What :func:`plan_site` needs of an IR (one root at a time)."""

    def reading(self, root):
        """The root's first reading (the kernel its rhs): :class:`RootInfo` or a refusal."""

    def alternatives(self, root) -> list:
        """Its other readings (the weight on the lhs of a dot), asked only where needed."""

    def root_refusal(self, root):
        """A reason to refuse the root before any reading is walked, or None."""

    def kernel_known(self, root, info: RootInfo) -> bool:
        """Whether the kernel of ``info`` is known now or shaped as a weight."""

    def walk(self, root, info: RootInfo) -> Walked:
        """The chain after the root, the channels on ``info.channel_axis``."""

    def affine(self, steps: list) -> list:
        """The steps that absorb (not the ones the chain passes through)."""

    def kernel_from_root(self, root, info: RootInfo) -> bool:
        """Whether the kernel of ``info`` is computed from an activation."""

    def nothing(self, root, first) -> None:
        """Record a root without a reading that walks (``first``: its first reading)."""

    def claim(self, steps: list) -> None:
        """Mark the chain's ops as this site's."""

    def plan_forward(self, root, info: RootInfo) -> Any:
        """The forward fold before the root, or None (recorded by the planner)."""

    def record(self, root, info, status: str, **kw) -> Any:
        """Append a record of the site to the report."""

    def absorbed(self, steps: list) -> list[str]:
        """The names of the chain's ops, for the record."""

    def fold(self, root, info: RootInfo, walked: Walked, steps: list, affine: list, fwd,
             backward: bool) -> bool:
        """Fold the site (step 7); True where it is planned to be rewritten."""


def first_reading(ad: SiteIR, root, first, others):
    """``(reading, walk)`` of the first reading whose chain folds, else of the first one
    walked whose kernel is a weight, else of the first; None where none is walked (step 3).
    ``others()``: the readings after ``first``, asked only where the first does not fold and
    its kernel is no weight (an activation: Equinox's ``W @ x``, Gemma's reordered einsum)."""
    chosen = None
    if isinstance(first, RootInfo):
        w = ad.walk(root, first)
        kfa = ad.kernel_from_root(root, first)
        if chain_kind(s.kind for s in ad.affine(w.steps)) == "fold" and not kfa:
            return first, w
        chosen = (first, w)
    alternatives = others()
    if not alternatives:
        return chosen
    if chosen is not None and not kfa and ad.kernel_known(root, first):
        return chosen                   # (the first reads a weight: it stays)
    for info in alternatives:
        if not isinstance(info, RootInfo) or not ad.kernel_known(root, info):
            continue     # (an input on the lhs may as well be the activations)
        w = ad.walk(root, info)
        kfa = ad.kernel_from_root(root, info)
        folds = chain_kind(s.kind for s in ad.affine(w.steps)) == "fold" and not kfa
        if chosen is None or folds or not kfa:
            chosen = (info, w)           # (a weight's reading over an activation's)
        if folds or not kfa:
            break
    return chosen


def plan_site(ad: SiteIR, root) -> bool:
    """Plan the site at ``root`` (the steps of the module's docstring); True where it is
    planned to be rewritten."""
    first, alternatives = ad.reading(root), None

    def others():                    # (asked once, and only where needed)
        nonlocal alternatives
        if alternatives is None:
            alternatives = ad.alternatives(root)
        return alternatives
    if not isinstance(first, RootInfo) and not any(isinstance(r, RootInfo) for r in others()):
        ad.nothing(root, first)
        return False
    why = ad.root_refusal(root)
    if why is not None:
        ad.record(root, None, REFUSED, reason=why)
        return False
    chosen = first_reading(ad, root, first, others)
    if chosen is None:
        ad.nothing(root, first)
        return False
    info, w = chosen
    steps = w.steps
    affine = ad.affine(steps)
    status, reason = chain_status((s.kind for s in affine), w.stop, w.refusal)
    ad.claim(steps)
    fwd = ad.plan_forward(root, info)
    backward = status == FOLDED
    if not backward:
        if status == CANONICAL:
            ad.record(root, info, CANONICAL, absorbed=ad.absorbed(steps), reason=reason)
        elif not (fwd is not None and w.stop == UNUSED):
            ad.record(root, info, status, reason=reason)
        if fwd is None:
            return False
        if not affine:
            steps = []
        # else: a canonical bias after the root merges into the forward fold's bias, so the
        # result is conv + one bias and folding again changes nothing
    return ad.fold(root, info, w, steps, affine, fwd, backward)
