"""hlofold: fold inference-time BatchNorm (and any per-channel affine) into convolutions.

Public API:

* :func:`fold` — decorator for inference functions (plain or ``jax.jit``-ed).
* :func:`fold_jaxpr` — the jaxpr-to-jaxpr transformation behind it.
* :class:`FoldReport`, :class:`FoldSite` — what was folded, where, and why not the rest.
* :class:`Folded`, :class:`Split` — the decorated function and its prepare/apply split.
* :func:`lower`, :func:`export` — folded StableHLO text / ``jax.export`` artifacts.
* :func:`fold_stablehlo` — fold StableHLO modules other tools made (text, bytecode, exports).
* :func:`verify` — compare original and folded programs on every backend present.
* :func:`fold_params` — write folded weights back into the model's own parameter tree.
"""
from ._api import Folded, fold
from ._views import Split
from ._stablehlo.artifacts import fold_stablehlo
from ._export import export, lower
from ._jaxpr.fold import fold_jaxpr
from ._core.report import FoldReport, FoldSite
from ._stablehlo.ir import StableHLOError
from ._verify import VerificationError, VerifyReport, verify
from ._writeback import FoldedParams, ParamChange, fold_params

__all__ = ["fold", "fold_jaxpr", "FoldReport", "FoldSite", "Folded", "Split", "lower",
           "export", "fold_stablehlo", "verify", "VerifyReport", "VerificationError",
           "StableHLOError", "fold_params", "FoldedParams", "ParamChange"]
__version__ = "0.1.0"

from ._compat import warn_untested as _warn_untested  # noqa: E402

_warn_untested(stacklevel=3)      # once, on a JAX newer than the tested window
