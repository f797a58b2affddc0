"""hlofold: fold inference-time BatchNorm (and any per-channel affine) into convolutions.

Public API:

* :func:`fold` — decorator for inference functions (plain or ``jax.jit``-ed).
* :func:`fold_jaxpr` — the jaxpr-to-jaxpr transformation behind it.
* :class:`FoldReport`, :class:`FoldSite` — what was folded, where, and why not the rest.
* :class:`Folded`, :class:`Split` — the decorated function and its prepare/apply split.
"""
from ._api import Folded, Split, fold
from ._fold import fold_jaxpr
from ._report import FoldReport, FoldSite

__all__ = ["fold", "fold_jaxpr", "FoldReport", "FoldSite", "Folded", "Split"]
__version__ = "0.1.0"
