"""Folded StableHLO out of Python functions: ``hlofold.lower`` and ``hlofold.export``."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from ._api import Folded, fold


def _folded(f: Callable, freeze, kw) -> Folded:
    return f if isinstance(f, Folded) and not freeze and not kw else fold(f, freeze=freeze, **kw)


def lower(f: Callable, *args, freeze: Any = (), **fold_options) -> str:
    """Folded StableHLO text of ``f`` for ``args``: what
    ``jax.jit(f).lower(*args).as_text()`` gives, with every BatchNorm folded."""
    return _folded(f, freeze, fold_options).lower(*args).as_text()


def export(f: Callable, *args_or_specs, platforms: Sequence[str] | None = None,
           freeze: Any = (), **fold_options) -> jax.export.Exported:
    """A ``jax.export.Exported`` of the folded ``f``.

    ``args_or_specs`` are arrays or ``jax.ShapeDtypeStruct``s (symbolic shapes from
    ``jax.export.symbolic_shape`` work: the fold is shape-agnostic); ``platforms`` is passed
    to ``jax.export.export``. Serialize with ``.serialize()``; ``jax.export.deserialize(...)
    .call(...)`` runs it. Frozen arguments must be concrete arrays and are baked in.
    """
    folded = _folded(f, freeze, fold_options)
    return jax.export.export(jax.jit(folded), platforms=platforms)(*args_or_specs)
