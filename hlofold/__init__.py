"""hlofold: fold inference-time BatchNorm (and any per-channel affine) into convolutions.

Public API:

* :func:`fold` — decorator for inference functions (plain or ``jax.jit``-ed).
* :func:`fold_jaxpr` — the jaxpr-to-jaxpr transformation behind it.
* :class:`FoldReport`, :class:`FoldSite` — what was folded, where, and why not the rest.
* :class:`Folded`, :class:`Split` — the decorated function and its prepare/apply split.
* :func:`lower`, :func:`export` — folded StableHLO text / ``jax.export`` artifacts.
* :func:`fold_stablehlo` — fold StableHLO modules other tools made (text, bytecode, exports).
* :func:`callable` — a function that runs a StableHLO artifact (folded or not) through JAX.
* :func:`verify` — compare original and folded programs on every backend present.
* :func:`fold_params` — write folded weights back into the model's own parameter tree.
* :class:`CompatError` — a JAX internal hlofold reads changed (the fold that needs it is off).
"""
from hlofold._front.api import Folded, fold
from hlofold._front.views import Split
from hlofold._front.artifacts import fold_stablehlo, run_artifact as callable
from hlofold._front.export import export, lower
from hlofold._fold.jaxpr.fold import fold_jaxpr
from hlofold._base.report import FoldReport, FoldSite
from hlofold._ir.stablehlo.ir import StableHLOError
from hlofold._front.verify import VerificationError, VerifyReport, verify
from hlofold._front.writeback import FoldedParams, ParamChange, fold_params
from hlofold._compat import CompatError

__all__ = ["fold", "fold_jaxpr", "FoldReport", "FoldSite", "Folded", "Split", "lower",
           "export", "fold_stablehlo", "verify", "VerifyReport", "VerificationError",
           "StableHLOError", "fold_params", "FoldedParams", "ParamChange", "callable",
           "CompatError"]
__version__ = "0.1.0"

from ._compat import warn_untested as _warn_untested  # noqa: E402

_warn_untested(stacklevel=3)      # once, on a JAX newer than the tested window
