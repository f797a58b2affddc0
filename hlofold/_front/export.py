"""Folded StableHLO out of Python functions: ``hlofold.lower`` and ``hlofold.export``."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from hlofold import _compat as C
from .api import Folded, fold


def _nothing_frozen(freeze) -> bool:
    return freeze is None or (isinstance(freeze, (tuple, list)) and not freeze)


def _folded(f: Callable, freeze, kw) -> Folded:
    """``f`` folded for an artifact. Sites whose parameters are arguments of the artifact
    would rescale their kernel on every call: they fold (in the graph, guarded) only with
    ``in_graph=True``; frozen parameters fold as constants."""
    kw = {"in_graph": False, **kw}
    if isinstance(f, Folded):
        if _nothing_frozen(freeze) and f.in_graph == kw["in_graph"] and len(kw) == 1:
            return f
        f = f.__wrapped__
    return fold(f, freeze=() if freeze is None else freeze, **kw)


def lower(f: Callable, *args, freeze: Any = (), **fold_options) -> str:
    """Folded StableHLO text of ``f`` for ``args``: what
    ``jax.jit(f).lower(*args).as_text()`` gives, with every BatchNorm whose parameters are
    frozen (``freeze=``) folded — their folded kernels and biases constants in the module
    (on JAX 0.12.1 and later too, which passes the constants of its lowerings as arguments
    marked ``jax.const``); with ``in_graph=True`` also those whose parameters are arguments
    (rescaled in the graph, guarded)."""
    folded = _folded(f, freeze, fold_options)
    with C.constants_in_module():
        return folded.lower_with_arguments(*args).as_text()


def export(f: Callable, *args_or_specs, platforms: Sequence[str] | None = None,
           freeze: Any = (), **fold_options) -> jax.export.Exported:
    """A ``jax.export.Exported`` of the folded ``f``.

    ``args_or_specs`` are arrays or ``jax.ShapeDtypeStruct``s (symbolic shapes from
    ``jax.export.symbolic_shape`` work: the fold is shape-agnostic); ``platforms`` is passed
    to ``jax.export.export``. Serialize with ``.serialize()``; ``jax.export.deserialize(...)
    .call(...)`` runs it. Frozen arguments must be concrete arrays and are baked in.
    """
    folded = _folded(f, freeze, fold_options)
    if _nothing_frozen(freeze):
        return jax.export.export(jax.jit(folded), platforms=platforms)(*args_or_specs)
    # Frozen arguments are closed over (concrete, so they are baked in as constants); the
    # exported function takes the remaining positional arguments.
    names = folded.signature.positional()
    frozen = {i for i, n in enumerate(names) if n in folded.frozen and i < len(args_or_specs)}
    if not frozen:
        raise ValueError("hlofold.export: freeze= must name positional arguments that are "
                         "passed")
    held = {i: args_or_specs[i] for i in frozen}
    rest = [a for i, a in enumerate(args_or_specs) if i not in frozen]

    def with_frozen(*dyn):
        it = iter(dyn)
        return folded(*[held[i] if i in held else next(it)
                        for i in range(len(args_or_specs))])
    return jax.export.export(jax.jit(with_frozen), platforms=platforms)(*rest)
