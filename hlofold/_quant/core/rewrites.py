"""The quantization rewrites as values, and the one driver that runs them on either IR.

A rewrite is a small frozen value — :class:`Rotate`, :class:`Equalize`, :class:`Smooth` —
that says what to do, not how an IR does it; :func:`chain` composes them into one
(flattened, in order), as Optax's ``chain`` composes gradient transformations. :func:`run`
applies a chain to a :class:`RewriteView`: each IR adapter gives one view
(``hlofold._quant.jaxpr.rewrite.JaxprView`` over a parameter tree,
``hlofold._quant.stablehlo.driver.ModuleView`` over a module's constants), with one
method per rewrite; every rewrite runs on what the one before it left. The records come
back in a :class:`Rewritten`, each rewrite's own fields.

``fold_params(..., equalize=, smooth=, alpha=, rotate=, seed=)``, ``fold_stablehlo(...)``
and the CLI flags build their chain with :func:`from_options` (the order: rotate — then
smoothing sees the rotated channels —, equalize, smooth).

A new rewrite (bias correction, say) is a value here with its ``apply`` calling a view
method of its name, that method on the two views, and its records' field in
:class:`Rewritten`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from .rotation import Rotation


@dataclasses.dataclass
class Rewritten:
    """What a chain of rewrites did: each rewrite's records and the layers it left, why
    (:class:`~hlofold._quant.core.equalize.NotEqualized`, reasons with kinds)."""

    equalized: list = dataclasses.field(default_factory=list)
    not_equalized: list = dataclasses.field(default_factory=list)
    smoothed: list = dataclasses.field(default_factory=list)
    not_smoothed: list = dataclasses.field(default_factory=list)
    rotation: Rotation | None = None

    def __bool__(self) -> bool:
        """Whether a rewrite changed a weight."""
        return bool(self.equalized or self.smoothed or
                    (self.rotation is not None and self.rotation.reason is None))


class RewriteView(Protocol):
    """What the driver needs of an IR: one method per rewrite, each changing the weights
    in place (as the adapter holds them) and returning its records."""

    def rotate(self, seed: int) -> Rotation:
        """The residual stream rotated, or why not."""

    def equalize(self) -> tuple[list, list]:
        """``(equalized pairs, layers left)``."""

    def smooth(self, calibration: list, alpha: Any) -> tuple[list, list]:
        """``(smoothed pairs, layers left)``."""


@dataclasses.dataclass(frozen=True)
class Rotate:
    """Rotate a pre-norm decoder's residual stream by an orthogonal ``Q`` (:mod:`.rotation`)."""

    seed: int = 0

    def apply(self, view: RewriteView, into: Rewritten) -> None:
        into.rotation = view.rotate(self.seed)


@dataclasses.dataclass(frozen=True)
class Equalize:
    """Cross-layer equalization of every pair and residual stream (:mod:`.equalize`)."""

    def apply(self, view: RewriteView, into: Rewritten) -> None:
        done, left = view.equalize()
        into.equalized += done
        into.not_equalized += left


@dataclasses.dataclass(frozen=True)
class Smooth:
    """SmoothQuant's scales from the activations of ``calibration`` (the adapter's form of
    the inputs: lists of a call's arrays), ``alpha`` a number or ``"search:…"``
    (:mod:`.smooth`, :mod:`.smooth_search`)."""

    calibration: tuple
    alpha: Any = 0.5

    def apply(self, view: RewriteView, into: Rewritten) -> None:
        done, left = view.smooth(list(self.calibration), self.alpha)
        into.smoothed += done
        into.not_smoothed += left


REWRITES = (Rotate, Equalize, Smooth)


def chain(*rewrites) -> tuple:
    """One rewrite of several (each a rewrite or a chain), applied in order."""
    out = []
    for r in rewrites:
        if isinstance(r, tuple):
            out.extend(chain(*r))
        elif isinstance(r, REWRITES):
            out.append(r)
        else:
            raise TypeError(f"not a rewrite: {r!r} (hlofold rewrites are "
                            f"{', '.join(c.__name__ for c in REWRITES)})")
    return tuple(out)


def from_options(*, equalize: bool = False, smooth=None, alpha: Any = 0.5,
                 rotate: bool = False, seed: int = 0) -> tuple:
    """The chain the keyword options ask for: rotate, equalize, smooth (``smooth``: the
    calibration inputs already in the adapter's form, or None)."""
    return chain(*([Rotate(seed)] if rotate else []), *([Equalize()] if equalize else []),
                 *([Smooth(tuple(smooth), alpha)] if smooth is not None else []))


def calibrations(rewrites: tuple, convert) -> tuple:
    """``rewrites`` with each :class:`Smooth`'s calibration inputs converted (``convert``)."""
    return tuple(dataclasses.replace(r, calibration=tuple(convert(list(r.calibration))))
                 if isinstance(r, Smooth) else r for r in rewrites)


def run(rewrites: tuple, view: RewriteView) -> Rewritten:
    """Each rewrite of the chain applied to ``view`` in turn; their records."""
    into = Rewritten()
    for r in rewrites:
        r.apply(view, into)
    return into
