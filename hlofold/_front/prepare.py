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
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._fold.jaxpr.fold import fold_jaxpr
from hlofold._base.report import FOLDED, FoldReport
from .tune import apply_program, share_choice

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
                                     for c in list(self.apply.consts) + nested_consts(self.apply)))
        return self._structure


def nested_consts(closed) -> list:
    """The constants held inside the nested jaxprs of ``closed`` (a body whose constants
    could not be hoisted: a ``custom_jvp`` call's): they are part of the program, which the
    printed jaxpr does not show."""
    out, stack, seen = [], [closed.jaxpr], set()
    while stack:
        j = stack.pop()
        for eqn in j.eqns:
            for x, closed in C.param_jaxprs(eqn):
                if id(x) not in seen:
                    seen.add(id(x))
                    if closed:
                        out.extend(x.consts)
                    stack.append(x.jaxpr if closed else x)
    return out


def fold_with_values(closed: C.ClosedJaxpr, names: Sequence[str], const_names: Sequence,
                     known_idx: Sequence[int], values: Sequence[Any], *,
                     float32_kernels: bool, cost: bool = False, merge: bool = True) -> Folding:
    """Fold ``closed`` with its inputs ``known_idx`` bound to ``values`` (with ``cost``,
    under the cost rule: they are prepared copies)."""
    j = closed.jaxpr
    known = set(known_idx)
    bound = C.closed_jaxpr(
        j.replace(constvars=list(j.constvars) + [j.invars[i] for i in known_idx],
                  invars=[v for i, v in enumerate(j.invars) if i not in known]),
        list(closed.consts) + list(values))
    known_names = {names[i] for i in known_idx}
    folded, report = fold_jaxpr(
        bound, invar_names=[n for i, n in enumerate(names) if i not in known],
        const_names=list(const_names) + [names[i] for i in known_idx],
        float32_kernels=float32_kernels, in_graph="never",
        cost=[names[i] for i in known_idx] if cost else None, merge=merge)
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
    return (C.closed_jaxpr(new, [c for c, m in zip(closed.consts, lift) if not m]),
            [c for c, m in zip(closed.consts, lift) if m])


class Executables:
    """Compiled apply programs of one input signature, one per fold structure."""

    def __init__(self, donated_per_call: Sequence[int], options: dict | None = None):
        self._donated = tuple(donated_per_call)
        self._options = options         # the user's jit's compiler_options
        self._entries: list[tuple[Folding, Callable]] = []

    def get(self, folding: Folding) -> Callable:
        for f, fn in self._entries:
            if f is folding or f.structure == folding.structure:
                if f is not folding:        # the same program: the same choice of options
                    share_choice(fn, f.report, folding.report)
                return fn
        n = len(folding.hoisted)
        fn = apply_program(C.jaxpr_as_fun(folding.apply), folding.report, self._options,
                           donate_argnums=tuple(n + k for k in self._donated),
                           effects=bool(folding.apply.effects))
        if len(self._entries) >= 8:
            self._entries.pop(0)
        self._entries.append((folding, fn))
        return fn


def place(hoisted: Sequence[Any], like: Sequence[Any]) -> list:
    """Device arrays of the hoisted constants, placed like the parameters they come from.

    A constant that *is* a parameter passes through; a new one (a folded kernel or bias)
    takes the sharding of a parameter of its shape (a folded kernel keeps its kernel's), or
    of its shape without size-1 dimensions (a bias ``(1, 1, 1, C)`` the BatchNorm vectors'
    ``(C,)``: the channel stays sharded as in the original program, so its output comes back
    in ``jax.jit``'s sharding), else is replicated over the parameters' mesh or put on their
    device."""
    # uncommitted parameters (made without a placement) leave the new ones uncommitted too,
    # so jit places them with the per-call inputs as it would have placed the parameters
    arrays = [a for a in like if isinstance(a, jax.Array) and not C.is_tracer(a)
              and a.committed]
    by_shape: dict = {}
    for a in arrays:     # of the parameters of one shape, the most sharded (what jax.jit's
        # output takes where they meet: β replicated beside γ on "model" gives "model")
        old = by_shape.get(tuple(a.shape))
        if old is None or _sharded_axes(a.sharding) > _sharded_axes(old):
            by_shape[tuple(a.shape)] = a.sharding
    default = None
    if arrays:
        sh = arrays[0].sharding
        default = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
                   if isinstance(sh, jax.sharding.NamedSharding) else
                   jax.sharding.SingleDeviceSharding(next(iter(sh.device_set)))
                   if len(sh.device_set) == 1 else None)
    out = []
    # placed now even where the call is being traced (a folded function first called
    # inside the user's jit): the values are cached for later calls, never a tracer
    with jax.ensure_compile_time_eval():
        for c in hoisted:
            if isinstance(c, jax.Array):
                out.append(c)
                continue
            target = by_shape.get(tuple(np.shape(c))) or \
                _squeezed_like(np.shape(c), by_shape) or default
            out.append(jax.device_put(c, target) if target is not None else jax.device_put(c))
    return out


def _sharded_axes(sharding) -> int:
    """How many mesh axes a sharding splits an array over (0 where it names none)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return 0
    return sum(len(p) if isinstance(p, tuple) else 1 for p in spec if p is not None)


def _squeezed_like(shape, by_shape: dict):
    """The sharding of a parameter whose shape is ``shape`` without its size-1 dimensions,
    spread over ``shape`` (those dimensions unsharded); None where there is none."""
    squeezed = tuple(d for d in shape if d != 1)
    sh = by_shape.get(squeezed) if len(squeezed) < len(shape) else None
    if not isinstance(sh, jax.sharding.NamedSharding):
        return None
    spec = iter(tuple(sh.spec) + (None,) * (len(squeezed) - len(sh.spec)))
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(
        *[None if d == 1 else next(spec) for d in shape]))


def _dtype(c):
    return getattr(c, "dtype", np.asarray(c).dtype)


# ----------------------------------------------------------------- on the parameters' devices


def on_device(arrays: Sequence[Any]) -> bool:
    """Whether parameters should be prepared where they live rather than on the host: any of
    them spans processes, is sharded over several devices, or is on an accelerator (copying
    it to the host and back would cost more than the fold)."""
    for a in arrays:
        if not isinstance(a, jax.Array) or C.is_tracer(a):
            continue
        devices = a.sharding.device_set
        if not a.is_fully_addressable or len(devices) > 1 or \
                next(iter(devices)).platform != "cpu":
            return True
    return False


@dataclasses.dataclass
class DevicePrepare:
    """The prepare step of one input signature as a compiled program on the parameters'
    devices (their sharding, nothing gathered to the host): the program folded with the
    rescale in the graph (``in_graph="unguarded"``), split by partial evaluation into the
    part that reads only the parameters (``prepare``: their folded kernels and biases, and
    ``ok``, whether those are finite) and the per-call part (``apply``)."""

    folding: Folding             # report; apply (inputs: residuals, then per-call leaves)
    prepare: Callable            # parameters -> (residuals, ok)
    apply: Callable              # (*residuals, *per-call leaves) -> outputs


def device_prepare(closed: C.ClosedJaxpr, names: Sequence[str], const_names: Sequence,
                   known_idx: Sequence[int], *, float32_kernels: bool,
                   cost: bool, merge: bool = True, options: dict | None = None) -> DevicePrepare:
    """The :class:`DevicePrepare` of ``closed`` whose inputs ``known_idx`` are parameters."""
    import jax.numpy as jnp
    folded, report = fold_jaxpr(closed, invar_names=names, const_names=const_names,
                                float32_kernels=float32_kernels, in_graph="unguarded",
                                cost=[] if cost else None, merge=merge)
    for s in report.sites:
        if s.status == FOLDED and s.rescale == "in-graph":
            s.rescale = PREPARED
            s.note = "; ".join(filter(None, [s.note, "prepared on the parameters' devices"]))
    known = set(known_idx)
    n_in = len(folded.jaxpr.invars)
    known_j, unknown_j, _, _ = C.partial_eval(
        folded, [i not in known for i in range(n_in)], [True] * len(folded.jaxpr.outvars))
    params_in = set(known_j.jaxpr.invars)
    computed = [isinstance(v, C.Var) and v not in params_in and
                jnp.issubdtype(v.aval.dtype, jnp.floating) for v in known_j.jaxpr.outvars]

    def prepare(*params):
        res = C.jaxpr_as_fun(known_j)(*params)
        ok = jnp.bool_(True)
        for r, c in zip(res, computed):
            if c:
                ok = jnp.logical_and(ok, jnp.all(jnp.isfinite(r)))
        return list(res), ok
    return DevicePrepare(Folding(report, folded, unknown_j, []), jax.jit(prepare),
                         apply_program(C.jaxpr_as_fun(unknown_j), report, options,
                                       effects=bool(unknown_j.effects)))


def device_entry(prog, known: list, *, float32_kernels: bool, cost: bool,
                 merge: bool = True):
    """``(Folding, apply, values)`` for parameters ``known`` of ``prog`` (an input
    signature's ``_dispatch.Program``), prepared on their devices (:func:`device_prepare`,
    made once per signature). Folded values that are not finite (σ² = 0 with ε = 0, an inf
    γ) run the original program for these parameters, with a warning."""
    if prog.device is None:
        prog.device = device_prepare(prog.original, prog.leaf_names, prog.const_names,
                                     prog.known_idx, float32_kernels=float32_kernels,
                                     cost=cost, merge=merge, options=prog.options)
    dp = prog.device
    with jax.ensure_compile_time_eval():     # run now, also under the user's trace (cached)
        residuals, ok = dp.prepare(*known)
        ok = bool(ok)
    if ok:
        return dp.folding, dp.apply, residuals
    warnings.warn("hlofold: these parameters fold to values that are not finite (σ² = 0 "
                  "with ε = 0, an inf γ); calls with them run the original program",
                  RuntimeWarning, stacklevel=5)
    n, order = len(prog.leaf_names), list(prog.known_idx) + list(prog.unknown_idx)

    def original(*args):            # (*parameters, *per-call leaves) -> outputs
        leaves = [None] * n
        for i, a in zip(order, args):
            leaves[i] = a
        return C.jaxpr_as_fun(prog.original)(*leaves)
    return Folding(FoldReport([]), prog.original, prog.original, []), jax.jit(
        original, compiler_options=prog.options), \
        list(known)
