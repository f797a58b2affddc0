"""The quantization rewrites of a StableHLO module — ``fold_stablehlo(..., equalize=True)``,
``smooth=[inputs...]`` — as :class:`ModuleView`, the StableHLO adapter's view the driver
(:func:`hlofold._quant.core.rewrites.run`) applies them to: on ``@main`` (its weights
constants, the fold done) and in its scanned stacks' loops (:mod:`.loop_pairs`, per layer)."""
from __future__ import annotations

from hlofold._fold.stablehlo.calls import inline_layer_calls
from hlofold._ir.stablehlo.module import drop_uncalled_private, main_function
from hlofold._quant.core.rewrites import Rewritten, run
from hlofold._quant.core.rotation import Rotation
from .equalize import equalize_function, smooth_function
from .loop_pairs import equalize_loops, smooth_loops, unmark_loops


class ModuleView:
    """A module's constants as the rewrites see them (``names``: constant op -> what the
    user calls it, ``"arg3"``; ``hoist``: the weights' hoisting, for calibration runs).
    Jitted helpers' layers are read where they are called (inlined once, before the first
    rewrite)."""

    def __init__(self, module, names: dict, hoist):
        self.module, self.names, self.hoist = module, names, hoist
        self._inlined = False

    def _read(self):
        if not self._inlined:
            self._inlined = True
            if inline_layer_calls(self.module):
                drop_uncalled_private(self.module)

    def rotate(self, seed: int) -> Rotation:
        return Rotation("rotate= rotates a parameter tree (hlofold.fold_params), not a "
                        "StableHLO module")

    def equalize(self) -> tuple[list, list]:
        self._read()
        recs, left = equalize_loops(self.module, self.names)
        top, top_left = equalize_function(main_function(self.module), self.names)
        unmark_loops(self.module)
        return top + recs, top_left + left

    def smooth(self, calibration: list, alpha) -> tuple[list, list]:
        self._read()
        recs, left = smooth_loops(self.module, self.names, calibration, alpha, self.hoist)
        done, top_left = smooth_function(self.module, self.names, calibration, alpha,
                                         self.hoist)
        unmark_loops(self.module)
        return done + recs, top_left + left


def quantization_ready(module, report, names: dict, rewrites: tuple, hoist) -> Rewritten:
    """``rewrites`` (:mod:`hlofold._quant.core.rewrites`) applied to the module, their
    records set in ``report``."""
    got = run(rewrites, ModuleView(module, names, hoist))
    report.equalized, report.not_equalized = got.equalized, got.not_equalized
    report.smoothed, report.not_smoothed = got.smoothed, got.not_smoothed
    return got
