"""The prepare step of :func:`hlofold.fold`: fold for given parameter values, on the host.

The user's function is traced once per input signature with every input abstract. For
concrete parameter values (the inputs a folded site reads: kernels, BatchNorm statistics),
those inputs become constants and :func:`hlofold.fold_jaxpr` folds them at transform time —
``K ⊙ s`` and ``t`` in float64 on the host, with the same safety rules as frozen constants
(a non-finite scale or an underflowing channel refuses that site, with its reason). The
constants of the result are then *hoisted*: passed to one compiled apply program as
arguments instead of being embedded in its HLO. So

* there is no XLA compile for the prepare step, and none for new parameter values whose fold
  has the same structure (the apply executable is reused);
* the HLO carries no weights: its compile time does not grow with them, and JAX's
  persistent compilation cache (keyed by the HLO) applies.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from . import _compat as C
from ._jaxpr.fold import fold_jaxpr
from ._core.report import FOLDED, FoldReport

PREPARED = "prepared"     # FoldSite.rescale of a site folded from prepared (input) values


@dataclasses.dataclass
class Folding:
    """The fold of one program for one set of parameter values."""

    report: FoldReport
    folded: C.ClosedJaxpr       # inputs: the per-call leaves; parameters are constants
    apply: C.ClosedJaxpr        # inputs: (*hoisted constants, *per-call leaves)
    hoisted: list               # values of the hoisted constants (NumPy or jax.Array)
    _structure: Any = None

    @property
    def structure(self) -> Any:
        """Equal for two foldings whose apply programs are the same up to the values of
        the hoisted constants (so one executable runs both)."""
        if self._structure is None:
            self._structure = (str(self.apply.jaxpr),
                               tuple((np.dtype(_dtype(c)).str, np.asarray(c).tobytes())
                                     for c in self.apply.consts))
        return self._structure


def fold_with_values(closed: C.ClosedJaxpr, names: Sequence[str], const_names: Sequence,
                     known_idx: Sequence[int], values: Sequence[Any], *,
                     float32_kernels: bool, cost: bool = False) -> Folding:
    """Fold ``closed`` with its inputs ``known_idx`` bound to ``values`` (with ``cost``,
    under the cost rule: they are prepared copies)."""
    j = closed.jaxpr
    known = set(known_idx)
    bound = C.ClosedJaxpr(
        j.replace(constvars=list(j.constvars) + [j.invars[i] for i in known_idx],
                  invars=[v for i, v in enumerate(j.invars) if i not in known]),
        list(closed.consts) + list(values))
    known_names = {names[i] for i in known_idx}
    folded, report = fold_jaxpr(
        bound, invar_names=[n for i, n in enumerate(names) if i not in known],
        const_names=list(const_names) + [names[i] for i in known_idx],
        float32_kernels=float32_kernels, in_graph="never",
        cost=[names[i] for i in known_idx] if cost else None)
    for s in report.sites:
        if s.status == FOLDED and s.rescale == "constant" and known_names & (
                set(s.params) | set((s.kernel or "").split(", "))):
            s.rescale = PREPARED
    return folding_of(folded, report)


def folding_of(folded: C.ClosedJaxpr, report: FoldReport) -> Folding:
    """The :class:`Folding` of an already folded program (constants hoisted)."""
    apply, hoisted = hoist(folded)
    return Folding(report, folded, apply, hoisted)


def hoist(closed: C.ClosedJaxpr) -> tuple[C.ClosedJaxpr, list]:
    """Non-scalar constants of ``closed`` as leading inputs: ``(jaxpr, their values)``.
    Scalars stay constants (XLA folds them into the arithmetic)."""
    j = closed.jaxpr
    lift = [np.ndim(c) > 0 for c in closed.consts]
    moved = [v for v, m in zip(j.constvars, lift) if m]
    new = j.replace(constvars=[v for v, m in zip(j.constvars, lift) if not m],
                    invars=moved + list(j.invars))
    return (C.ClosedJaxpr(new, [c for c, m in zip(closed.consts, lift) if not m]),
            [c for c, m in zip(closed.consts, lift) if m])


class Executables:
    """Compiled apply programs of one input signature, one per fold structure."""

    def __init__(self, donated_per_call: Sequence[int]):
        self._donated = tuple(donated_per_call)
        self._entries: list[tuple[Folding, Callable]] = []

    def get(self, folding: Folding) -> Callable:
        for f, fn in self._entries:
            if f is folding or f.structure == folding.structure:
                return fn
        n = len(folding.hoisted)
        fn = jax.jit(C.jaxpr_as_fun(folding.apply),
                     donate_argnums=tuple(n + k for k in self._donated))
        if len(self._entries) >= 8:
            self._entries.pop(0)
        self._entries.append((folding, fn))
        return fn


def place(hoisted: Sequence[Any], like: Sequence[Any]) -> list:
    """Device arrays of the hoisted constants, placed like the parameters they come from.

    A constant that *is* a parameter passes through; a new one (a folded kernel or bias)
    takes the sharding of a parameter of its shape (a folded kernel keeps its kernel's),
    else is replicated over the parameters' mesh or put on their device."""
    # uncommitted parameters (made without a placement) leave the new ones uncommitted too,
    # so jit places them with the per-call inputs as it would have placed the parameters
    arrays = [a for a in like if isinstance(a, jax.Array) and not C.is_tracer(a)
              and a.committed]
    by_shape: dict = {}
    for a in arrays:
        by_shape.setdefault(tuple(a.shape), a.sharding)
    default = None
    if arrays:
        sh = arrays[0].sharding
        default = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
                   if isinstance(sh, jax.sharding.NamedSharding) else
                   jax.sharding.SingleDeviceSharding(next(iter(sh.device_set)))
                   if len(sh.device_set) == 1 else None)
    out = []
    for c in hoisted:
        if isinstance(c, jax.Array):
            out.append(c)
            continue
        target = by_shape.get(tuple(np.shape(c)), default)
        out.append(jax.device_put(c, target) if target is not None else jax.device_put(c))
    return out


def _dtype(c):
    return getattr(c, "dtype", np.asarray(c).dtype)
