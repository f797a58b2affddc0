"""The rewrites asked of a StableHLO module, in order: ``equalize=`` then ``smooth=`` on its
``@main`` (its weights constants, the fold done) and in its scanned stacks' loops
(:mod:`.loop_pairs`, per layer), their records added to the report."""
from __future__ import annotations

from hlofold._fold.stablehlo.calls import inline_layer_calls
from hlofold._ir.stablehlo.module import drop_uncalled_private, main_function
from .equalize import equalize_function, smooth_function
from .loop_pairs import equalize_loops, smooth_loops, unmark_loops


def quantization_ready(module, report, names: dict, equalize: bool, smooth, alpha: float,
                       hoist) -> None:
    """``equalize=`` then ``smooth=`` on the module's ``@main`` (its weights constants, the
    fold done), their records added to ``report``: in its scanned stacks too
    (:mod:`.loop_pairs`, per layer)."""
    if (equalize or smooth is not None) and inline_layer_calls(module):
        drop_uncalled_private(module)  # jitted helpers' layers read where they are called
    if equalize:
        recs, left = equalize_loops(module, names)
        top, top_left = equalize_function(main_function(module), names)
        unmark_loops(module)
        report.equalized, report.not_equalized = top + recs, top_left + left
    if smooth is not None:
        recs, left = smooth_loops(module, names, smooth, alpha, hoist)
        done, top_left = smooth_function(module, names, smooth, alpha, hoist)
        unmark_loops(module)
        report.equalized += done + recs
        report.not_equalized += [n for n in top_left + left if n not in report.not_equalized]
