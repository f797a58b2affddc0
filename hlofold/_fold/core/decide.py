"""The site decision, made once for both IR paths.

After the chain walk (``_fold.core.chain.walk``), an adapter (``_fold.jaxpr.plan`` on a jaxpr, ``_fold.stablehlo.fold``
on a module) gathers what it knows about a site and asks two questions here:

* :func:`chain_status`: does the walked chain fold at all (nothing to fold, already a
  canonical bias, or a fold)?
* :func:`decide`: may this fold be made, and how? The rules of ``_fold.core.rules`` are applied in
  one order, on both paths, so that a site failing two rules is refused for the same one:

  1. the kernel is not computed from an activation;
  2. the chain does not compute in a wider float type than the (folded) kernel
     (``precision_refusal``), and nothing known now depends on subnormal numbers that a
     backend flushes (``SUBNORMAL``, detected by each adapter's evaluator with
     ``flushes_differently``);
  3. a scale known now is finite (``scale_refusal``);
  4. a kernel known now, rescaled in float64 and rounded once, neither overflows nor
     underflows a channel (``round_kernel``): the fold is made now, a constant;
  5. otherwise ``K ⊙ s`` is computed in the graph, as the ``in_graph`` policy says:

     * ``"never"``: refused, with the adapter's words for how to fold it instead;
     * ``"prepared"``: folded, unguarded; the caller computes the parameter-only part once
       and checks it on the host (``hlofold.fold``'s prepare step);
     * ``"unguarded"``: folded, unguarded; the caller checks only finiteness at run time
       (``hlofold._fold.stablehlo.split``), so narrow kernels are refused (``runtime_refusal``);
     * ``"guarded"``: as ``"unguarded"``, and a site whose scale is known only at run time
       gets a run-time guard that runs its original ops when the fold is not finite.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import numpy as np

from hlofold._base.algebra import along
from .chain import CANONICAL_BIAS, KERNEL_FROM_ACTIVATION, chain_kind
from hlofold._base.report import CANONICAL, FOLDED, NO_PATTERN, REFUSED
from hlofold._base.reasons import Reason
from .rules import SUBNORMAL, precision_refusal, round_kernel, runtime_refusal, scale_refusal

IN_GRAPH_POLICIES = ("guarded", "unguarded", "prepared", "never")


def chain_status(kinds: Iterable[str], stop: str | None, stop_is_refusal: bool
                 ) -> tuple[str, str | None]:
    """``(status, reason)`` of a walked chain with these affine step kinds: ``FOLDED`` (and
    no reason) when it folds; else why not."""
    shape = chain_kind(kinds)
    if shape == "none":
        return (REFUSED if stop_is_refusal else NO_PATTERN), stop
    if shape == "canonical":
        return CANONICAL, CANONICAL_BIAS
    return FOLDED, None


@dataclasses.dataclass
class Decision:
    """What :func:`decide` found: ``reason`` (None: the site folds), the rounded folded
    kernel when it is computed now, how the kernel is rescaled, and whether the site is
    guarded at run time."""

    reason: str | None = None
    kernel: np.ndarray | None = None
    rescale: str | None = None          # "constant" | "in-graph"
    guard: bool = False

    @property
    def folds(self) -> bool:
        return self.reason is None


def decide(*, kernel_dtype, math_dtypes: Sequence, s: np.ndarray | None,
           kernel: np.ndarray | None, kernel_axis: int, in_graph: str, not_now: str,
           kernel_from_activation: bool = False, hint: str = "",
           scale_known: bool | None = None, subnormal: bool = False,
           kernel_factors: Sequence = ()) -> Decision:
    """The decision for one site (the order is the module docstring's).

    Args:
      kernel_dtype: the dtype the folded kernel is rounded to.
      math_dtypes: the dtypes the chain computes in (the root's output and each step's).
      s: the float64 scale per output channel when it is known now, else None.
      kernel: the kernel's values when they are known now (and nothing before the root that is
        only known at run time rescales it), else None.
      kernel_axis: the kernel's output-feature axis.
      in_graph: one of :data:`IN_GRAPH_POLICIES`.
      not_now: the reason for ``in_graph="never"``, in the adapter's words.
      kernel_from_activation: the kernel is computed from an activation.
      hint: appended to a precision refusal (how to keep a wider kernel).
      scale_known: every scale of the site is known now (default: ``s is not None``); a
        guarded site is guarded when it is not.
      subnormal: a value of the site computed now depends on subnormal numbers.
      kernel_factors: what else the kernel is multiplied by before it is rounded (a forward
        fold's input scale, ``_base.algebra.input_scale``): rounded once with ``s``.
    """
    if in_graph not in IN_GRAPH_POLICIES:
        raise ValueError(f"in_graph must be one of {IN_GRAPH_POLICIES}, got {in_graph!r}")
    if kernel_from_activation:
        return Decision(KERNEL_FROM_ACTIVATION)
    why = precision_refusal(kernel_dtype, math_dtypes, hint)
    if why:
        return Decision(why)
    if subnormal:
        return Decision(SUBNORMAL)
    if s is not None:
        why = scale_refusal(s)
        if why:
            return Decision(why)
        if kernel is not None:
            k_new, why = round_kernel(
                kernel, [along(s, kernel_axis, kernel.ndim), *kernel_factors], kernel_dtype,
                kernel_axis)
            return Decision(why) if why else Decision(None, k_new, "constant")
    if in_graph == "never":
        return Decision(not_now)
    if in_graph != "prepared":
        why = runtime_refusal(kernel_dtype)
        if why:
            return Decision(why)
    known = s is not None if scale_known is None else scale_known
    return Decision(None, None, "in-graph", in_graph == "guarded" and not known)


BIAS_MAP_IN_GRAPH = Reason("bias-map", "a shift in front of a padded convolution folds into a "
                           "per-position bias map conv(pad(t), K), which is computed once at "
                           "transform time only; here the kernel or the shift is computed in "
                           "the graph")


def forward_refusal(*, kernel_dtype, step_dtypes: Sequence, hint: str, bias_map: bool,
                    in_graph: str, all_known: bool, s_in: np.ndarray | None) -> str | None:
    """The forward fold's own rules (an affine *in front of* a root), before :func:`decide`:
    the chain in front computes no wider than the kernel; a bias map (a shift in front of a
    padded convolution) only of values known now (``all_known``: the kernel, the chain in
    front and the one after); a finite input scale ``s_in`` (None: known at run time only)."""
    why = precision_refusal(kernel_dtype, step_dtypes, hint)
    if not why and bias_map and in_graph != "never" and not all_known:
        why = BIAS_MAP_IN_GRAPH
    if not why and s_in is not None:
        why = scale_refusal(s_in, "input scale s")
    return why or None


MULTI_OUTPUT_SHIFT = Reason(
    "root", "a shift in front of a projection with several output dimensions that are not "
    "one block (not contiguous in its kernel) would add a bias over all of them, which is "
    "not written; only a scale (RMSNorm's γ) folds forward into it")


def multi_output_shift(shift: bool, free_dims: int, block: bool = False) -> Reason | None:
    """The forward fold into a dot whose weight has ``free_dims`` output dimensions: a scale
    folds along the contracted axis whatever they are; a shift adds a bias over all of
    them, which the root's channels carry when they are one ``Block`` (a multi-head
    (d, heads, head_dim) kernel), else refused with :data:`MULTI_OUTPUT_SHIFT`."""
    return MULTI_OUTPUT_SHIFT if shift and free_dims > 1 and not block else None


def forward_consumers_refusal(n: int, at_top: bool, output_of: Optional[str],
                              readers: Iterable[tuple]) -> Optional[str]:
    """The consumers rule of a chain in front of a root, for both paths: a value ``n`` ops
    read may be taken when it has one reader, or when it is the roots' input
    (``at_top``) and is not a program output (``output_of``: what it is an output of) and
    every reader is a linear root reading it as its input features. ``readers`` yields, on
    demand, ``(name, is a root, reads it as its features, operand position, file, line)``."""
    if n == 1:
        return None
    if not at_top:
        return Reason("consumers", f"a value before the root has {n} consumers")
    if output_of:
        return Reason("consumers", f"the root's input has {n} consumers, one of them an "
                      f"output of the {output_of}, which would change")
    for name, is_root, linear, pos, file, line in readers:
        if not linear:
            what = name if not is_root else \
                f"{name} reading it as operand {pos} or along another axis"
            where = f" ({file}:{line})" if file else ""
            return Reason("consumers", f"the root's input has {n} consumers and "
                          f"{what}{where} is not a linear layer reading its features; "
                          "folding needs every consumer linear")
    return None


def forward_note(tokens: int, consumers: int, bias_map: bool, stop: Optional[str]
                 ) -> Optional[str]:
    """The report's note on a folded chain in front of a root, the same on both paths."""
    notes = []
    if tokens:
        notes.append(f"{tokens} per-token factor(s) kept in the graph")
    if consumers > 1:
        notes.append(f"the same chain is folded into each of the {consumers} linear consumers")
    if bias_map:
        notes.append("the padded border sees less of the shift: a per-position bias map")
    if stop:
        notes.append(f"chain stopped: {stop}")
    return "; ".join(notes) or None
