"""``@hlofold.fold``: the decorator for inference functions.

The decorated function is traced once per input signature (like ``jax.jit``), folded with
:func:`hlofold.fold_jaxpr`, and compiled. Parameters arrive either

* **frozen** (``freeze=``): their values are baked in as constants, so ``K ⊙ s`` is computed
  once at transform time and the program carries the folded kernels as constants; or
* **as inputs**: the folded program is split by partial evaluation into a param-only
  *prepare* part (folded kernels and biases) and a per-call *apply* part (conv + add). The
  prepared values are cached, keyed on the identity of the (immutable) ``jax.Array`` inputs
  they come from, so steady-state calls run only *apply*. :meth:`Folded.split` exposes the
  two parts for callers that keep state themselves.

Called under an enclosing transformation (inputs are tracers), the folded program is inlined
with its kernel rescale in the graph.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from . import _compat as C
from ._fold import fold_jaxpr
from ._report import FOLDED, FoldReport


def fold(fun: Callable | None = None, *, freeze: int | str | Sequence[int | str] = (),
         static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
         cache_prepared: bool = True, float32_kernels: bool = False, verify: bool = False,
         in_graph: bool = False):
    """Fold every BatchNorm (per-channel affine) after a convolution in ``fun``.

    Args:
      fun: an inference function, plain or already ``jax.jit``-ed (its static arguments are
        respected).
      freeze: argument numbers or names whose values are baked into the program as
        constants (like ``torch.jit.freeze``). A different array passed later re-freezes.
      static_argnums, static_argnames: as for ``jax.jit`` (for a plain ``fun``).
      cache_prepared: cache the prepared (folded) parameters between calls. With ``False``
        every call rescales the kernels (useful only for benchmarking).
      float32_kernels: for bf16/fp16 convolutions, keep the folded kernel in float32 and run
        the convolution in float32 (accuracy over speed). See :meth:`Folded.measure_precision`.
      verify: fail closed. On the first call for each input signature, run the folded and
        the original program on those inputs and compare every output: NaN and inf at the
        same places, and ``max|Δ| ≤ rtol·max|ref| + atol`` over the finite values, with
        ``(rtol, atol)`` from :func:`verify_tolerance` by output dtype — float32/float64:
        ``(1e-4, 1e-5)``, float16: ``(1e-2, 1e-3)``, bfloat16: ``(6e-2, 6e-3)``, anything
        else exact. These bounds catch a wrong fold (errors of the order of the outputs),
        not rounding; :meth:`Folded.measure_precision` measures that. Past the tolerance it
        warns (``RuntimeWarning`` naming the folded sites, ``file:line``) and runs the
        original program for that signature from then on. Calls whose inputs are tracers
        (under an enclosing transformation) are not verified.
      in_graph: what a call under an enclosing transformation (``jax.jit(fold(f))``,
        ``vmap``) does with sites whose parameters are traced, so that ``K ⊙ s`` would be
        recomputed on every call. ``False`` (default): leave them unfolded — the program is
        the original one there, never slower (on XLA:CPU the rescale costs more than it
        saves); :meth:`traced_report` says so per site. To fold everything under your own
        jit, prepare outside it: ``sp = folded.split(params, x)``, ``prepared =
        sp.prepare(params, x)``, then ``jax.jit(lambda p, x: sp.apply(p, params, x))``.
        ``True``: rescale in the graph, each site guarded at run time (a non-finite folded
        kernel or bias runs the original equations); fp16/fp8 kernels stay unfolded there.

    Returns a :class:`Folded` callable with ``.lower``, ``.report``, ``.jaxpr`` and ``.split``.
    """
    if fun is None:
        return functools.partial(fold, freeze=freeze, static_argnums=static_argnums,
                                 static_argnames=static_argnames, cache_prepared=cache_prepared,
                                 float32_kernels=float32_kernels, verify=verify,
                                 in_graph=in_graph)
    return Folded(fun, freeze=freeze, static_argnums=static_argnums,
                  static_argnames=static_argnames, cache_prepared=cache_prepared,
                  float32_kernels=float32_kernels, verify=verify, in_graph=in_graph)


_UNFOLDED = object()


def verify_tolerance(dtype) -> tuple[float, float] | None:
    """``(rtol, atol)`` for ``fold(..., verify=True)``: an output of this dtype passes when
    ``max|Δ| ≤ rtol·max|ref| + atol`` over its finite values. ``None``: compared exactly.

    float32/float64 ``(1e-4, 1e-5)``; float16 ``(1e-2, 1e-3)`` (10 ulps); bfloat16
    ``(6e-2, 6e-3)`` (8 ulps): room for the rounding a fold moves through a deep network,
    far below the error of a wrong fold (a wrong scale or bias errs by O(max|ref|)).
    """
    dt = np.dtype(dtype)
    if dt == np.dtype(jax.numpy.bfloat16):
        return 6e-2, 6e-3
    if dt == np.dtype(np.float16):
        return 1e-2, 1e-3
    if jax.numpy.issubdtype(dt, jax.numpy.inexact):
        return 1e-4, 1e-5
    return None


def _mismatch(ref, out) -> str | None:
    """Why ``out`` is not ``ref`` within :func:`verify_tolerance` (None: it is)."""
    r, o = np.asarray(ref), np.asarray(out)
    if r.shape != o.shape or r.dtype != o.dtype:
        return f"{o.dtype}{list(o.shape)} instead of {r.dtype}{list(r.shape)}"
    tol = verify_tolerance(r.dtype)
    if tol is None:
        return None if np.array_equal(r, o) else "values differ"
    r, o = r.astype(np.float64), o.astype(np.float64)
    if not (np.array_equal(np.isnan(r), np.isnan(o)) and
            np.array_equal(np.where(np.isinf(r), r, 0), np.where(np.isinf(o), o, 0))):
        return "NaN/inf at other places"
    fin = np.isfinite(r)
    if not fin.any():
        return None
    err = float(np.max(np.abs(r[fin] - o[fin])))
    bound = tol[0] * float(np.max(np.abs(r[fin]))) + tol[1]
    return None if err <= bound else f"max|Δ| = {err:.3g} > {bound:.3g}"


def _with_finite_flag(fun: Callable) -> Callable:
    """``fun`` returning ``(values, all_finite)``: one executable, checked on the device."""
    def wrapped(*args):
        vals = fun(*args)
        flags = [jax.numpy.isfinite(v).all() for v in vals
                 if jax.numpy.issubdtype(v.dtype, jax.numpy.inexact)]
        ok = jax.numpy.all(jax.numpy.stack(flags)) if flags else jax.numpy.bool_(True)
        return vals, ok
    return jax.jit(wrapped)


def _explicit_sharding(x):
    """``x``'s sharding when it is part of its type (a mesh with Explicit axes), else None."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding) and \
            jax.sharding.AxisType.Explicit in sh.mesh.axis_types:
        return sh
    return None


def _leaf_key(x):
    """Cheap per-call signature of one input: shape, dtype, weak type (or Python type), and
    the sharding where it is part of the type (explicit mesh axes)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or C.is_tracer(x):   # the same key as a concrete array of that type
        a = C.aval_of(x)
        return (tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
    key = (x.shape, dtype, bool(getattr(x, "weak_type", False)))
    sh = _explicit_sharding(x)
    return key if sh is None else key + (sh,)


def _trace_struct(x) -> jax.ShapeDtypeStruct:
    """The abstract value ``x`` is traced as: with explicit mesh axes its sharding is part of
    its type, and the traced program (and the jit around it) must keep it."""
    st = C.shape_struct(C.aval_of(x))
    sh = None if C.is_tracer(x) else _explicit_sharding(x)
    if sh is None:
        return st
    return jax.ShapeDtypeStruct(st.shape, st.dtype, weak_type=st.weak_type, sharding=sh)


def _static_key(static: dict) -> tuple:
    """Static arguments by name, type and value (``jax.jit`` tells ``2`` from ``2.0``)."""
    return tuple((k, type(v), v) for k, v in sorted(static.items(), key=lambda kv: kv[0]))


def _check_not_deleted(arrays) -> None:
    for a in arrays:
        if isinstance(a, jax.Array) and a.is_deleted():
            raise RuntimeError(f"hlofold: an input array has been deleted or donated "
                               f"(shape={a.shape}, dtype={a.dtype}); jax.jit would raise too")


def _frozen_leaf_key(x):
    """Cache key of one frozen value: arrays by identity (jax.Array is immutable; NumPy
    arrays are compared by content on every call, see ``_same_contents``), Python scalars
    by type and value."""
    if isinstance(x, (bool, int, float, complex, str, type(None))):
        return (type(x), x)
    _check_not_deleted([x])
    return (type(x), id(x))


def _same_contents(copies, leaves) -> bool:
    """Whether every frozen NumPy array still holds the values it was folded with."""
    for i, c in copies:
        x = leaves[i]
        if x.shape != c.shape or x.dtype != c.dtype or not np.array_equal(
                x, c, equal_nan=bool(np.issubdtype(c.dtype, np.inexact))):
            return False
    return True


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


@dataclasses.dataclass
class Split:
    """The folded program split in two.

    ``prepare(*args, **kw)`` computes, from the parameter inputs only, everything the
    per-call part needs (folded kernels, biases); ``apply(prepared, *args, **kw)`` runs the
    per-call part. ``apply`` reads only the inputs listed in ``per_call``; the ones in
    ``prepared_from`` are not read (pass the same pytree structure; their values are ignored).
    """

    prepared_from: list[str]
    per_call: list[str]
    prepare_jaxpr: C.ClosedJaxpr | None
    apply_jaxpr: C.ClosedJaxpr
    _folded: "Folded"
    _key: Any

    def prepare(self, *args, **kwargs) -> list[jax.Array]:
        """Raises ``FloatingPointError`` when a folded value is not finite (e.g. a BN
        scale of inf): such parameters cannot be folded."""
        prog, leaves = self._folded._program_for(args, kwargs)
        self._check(prog)
        prepared, finite = prog.prepare(*[leaves[i] for i in prog.known_idx])
        prepared = list(prepared)
        if not bool(finite):
            raise FloatingPointError("hlofold: the folded parameters are not finite (a "
                                     "BatchNorm scale is inf or NaN?); these parameters "
                                     "cannot be folded — call the original function")
        return prepared

    def apply(self, prepared: Sequence[jax.Array], *args, **kwargs):
        prog, leaves = self._folded._program_for(args, kwargs)
        self._check(prog)
        outs = prog.apply(*prepared, *[leaves[i] for i in prog.unknown_idx])
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def _check(self, prog):
        if prog.key != self._key:
            raise ValueError("hlofold: Split.prepare/apply called with inputs of another "
                             "signature than the one the split was made for")


@dataclasses.dataclass
class _Program:
    key: Any
    original: C.ClosedJaxpr
    folded: C.ClosedJaxpr
    report: FoldReport
    leaf_names: list[str]
    out_tree: Any
    full: Callable                 # jitted folded program (in-graph rescale)
    fold_args: dict                # invar/const names, to fold the original in another mode
    known_idx: list[int]
    unknown_idx: list[int]
    prepare: Callable | None
    apply: Callable | None
    prepare_jaxpr: C.ClosedJaxpr | None = None
    apply_jaxpr: C.ClosedJaxpr | None = None
    frozen_refs: tuple = ()        # keeps frozen arrays alive so their ids stay unique
    frozen_copies: tuple = ()      # (index, copy) of frozen NumPy arrays: checked every call
    donated: tuple = ()            # flat input positions donated (from a jitted input)
    unfolded: Callable | None = None  # the original program, for fail-closed fallback
    reference: Callable | None = None  # the original program without donation (verify)
    cached: tuple | None = None    # (known leaves, prepared values)
    verified: bool | None = None   # verify=True: None until the first call compared
    variants: dict = dataclasses.field(default_factory=dict)   # in_graph mode -> (jaxpr, report)


class Folded:
    """A folded inference function (see :func:`fold`)."""

    def __init__(self, fun, *, freeze, static_argnums, static_argnames, cache_prepared,
                 float32_kernels=False, verify=False, in_graph=False):
        self._float32_kernels = float32_kernels
        self._verify = verify
        self.in_graph = bool(in_graph)
        ji = C.jit_info(fun)
        self._fun = fun
        self._py = ji[0] if ji else fun
        sa = set(_as_tuple(static_argnums)) | set(ji[1] if ji else ())
        sn = set(_as_tuple(static_argnames)) | set(ji[2] if ji else ())
        try:
            self._sig = inspect.signature(self._py)
        except (TypeError, ValueError):
            self._sig = None
        self._static = self._to_names(sa | sn, "static")
        self._freeze = self._to_names(set(_as_tuple(freeze)), "freeze")
        # donation of a jitted input is kept for the per-call inputs it names
        self._donate = self._to_names(set(ji[3]) | set(ji[4]), "donate") if ji else frozenset()
        self._cache = cache_prepared
        self._programs: dict[Any, _Program] = {}
        self._failed: set = set()      # verify=True: signatures whose fold was found wrong
        functools.update_wrapper(self, self._py)
        self.__wrapped__ = fun        # the function as given (jitted or not)

    # ---- argument handling

    def _positional(self) -> list[str]:
        if self._sig is None:
            return []
        return [p.name for p in self._sig.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def _to_names(self, items, what) -> frozenset:
        pos = self._positional()
        out = set()
        for it in items:
            if isinstance(it, int):
                if self._sig is None:
                    out.add(f"#{it}")
                elif it < len(pos):
                    out.add(pos[it])
                else:
                    raise ValueError(f"hlofold.fold: {what} argnum {it} is out of range for "
                                     f"{getattr(self._py, '__name__', self._py)}{self._sig}")
            else:
                if self._sig is not None and it not in self._sig.parameters:
                    raise ValueError(f"hlofold.fold: {what} argname {it!r} is not a parameter "
                                     f"of {getattr(self._py, '__name__', self._py)}{self._sig}")
                out.add(it)
        return frozenset(out)

    def _arguments(self, args, kwargs) -> dict[str, Any]:
        if self._sig is None:
            if kwargs:
                out = {f"#{i}": a for i, a in enumerate(args)}
                out.update(kwargs)
                return out
            return {f"#{i}": a for i, a in enumerate(args)}
        bound = self._sig.bind(*args, **kwargs)
        return dict(bound.arguments)

    def _call_original(self, arguments: dict[str, Any]):
        if self._sig is None:
            pos = [v for k, v in arguments.items() if k.startswith("#")]
            kw = {k: v for k, v in arguments.items() if not k.startswith("#")}
            return self._fun(*pos, **kw)
        ba = inspect.BoundArguments(self._sig, arguments)
        return self._fun(*ba.args, **ba.kwargs)

    # ---- programs

    def _program_for(self, args, kwargs) -> tuple[_Program, list]:
        arguments = self._arguments(args, kwargs)
        static = {k: v for k, v in arguments.items() if k in self._static}
        frozen = {k: v for k, v in arguments.items() if k in self._freeze}
        dynamic = {k: v for k, v in arguments.items() if k not in self._static
                   and k not in self._freeze}
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        frz_leaves = jax.tree_util.tree_leaves(frozen)
        tracing = any(C.is_tracer(x) for x in leaves + frz_leaves)
        if tracing and any(C.is_tracer(x) for x in frz_leaves):
            # Frozen values that are tracers cannot be baked in: treat them as inputs.
            dynamic = {k: v for k, v in arguments.items() if k not in self._static}
            frozen = {}
            leaves, tree = jax.tree_util.tree_flatten(dynamic)
            frz_leaves = []
        avals = tuple(_leaf_key(l) for l in leaves)
        # As strict as jax.jit: static values by type and value, frozen values by pytree
        # structure (dict keys, static fields of modules) and identity or value.
        try:
            static_key = _static_key(static)
            frz_key = (jax.tree_util.tree_structure(frozen),
                       tuple(_frozen_leaf_key(x) for x in frz_leaves))
            key = (tree, avals, static_key, frz_key)
            hash(key)
        except TypeError as e:
            raise TypeError(f"hlofold.fold: static arguments (and the static fields of frozen "
                            f"arguments) must be hashable: {e}") from None
        prog = self._programs.get(key)
        if prog is not None and not _same_contents(prog.frozen_copies, frz_leaves):
            prog = None           # a frozen NumPy array was changed in place: fold again
        if prog is None:
            leaves_p = jax.tree_util.tree_flatten_with_path(dynamic)[0]
            prog = self._build(key, arguments, static, frozen, leaves_p, tree, frz_leaves)
            if len(self._programs) > 64:
                self._programs.pop(next(iter(self._programs)))
            self._programs[key] = prog
        return prog, leaves

    def _build(self, key, arguments, static, frozen, leaves_p, tree, frz_leaves) -> _Program:
        names = [self._leaf_name(p) for p, _ in leaves_p]
        leaves = [l for _, l in leaves_p]

        def flat_fun(*dyn_leaves):
            dyn = jax.tree_util.tree_unflatten(tree, dyn_leaves)
            merged = {k: (static[k] if k in static else frozen[k] if k in frozen else dyn[k])
                      for k in arguments}
            return self._call_original(merged)

        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(
            *[_trace_struct(l) for l in leaves])
        out_tree = jax.tree_util.tree_structure(out_shape)
        frz_p, _ = jax.tree_util.tree_flatten_with_path(frozen)
        by_id = {id(l): self._leaf_name(p) for p, l in frz_p}
        const_names = [by_id.get(id(c)) for c in closed.consts]
        folded, report = fold_jaxpr(closed, invar_names=names, const_names=const_names,
                                    float32_kernels=self._float32_kernels, in_graph="prepared")
        donated = tuple(i for i, (p, _) in enumerate(leaves_p)
                        if p and getattr(p[0], "key", None) in self._donate)
        full = jax.jit(C.jaxpr_as_fun(folded), donate_argnums=donated)

        # Inputs feeding a kernel rescale in the graph are "prepared" once per value.
        needed = set()
        for s in report.sites:
            if s.status == FOLDED and s.rescale == "in-graph":
                needed.update(s.params)
                if s.kernel:
                    needed.update(s.kernel.split(", "))
        known_idx = [i for i, n in enumerate(names) if n in needed]
        unknown_idx = [i for i in range(len(names)) if i not in set(known_idx)]
        prepare = apply = known_j = unknown_j = None
        if known_idx:
            unknowns = [i not in set(known_idx) for i in range(len(names))]
            known_j, unknown_j, out_uk, _ = C.partial_eval(
                folded, unknowns, [True] * len(folded.jaxpr.outvars))
            assert all(out_uk), "every output is instantiated in the apply part"
            prepare = _with_finite_flag(C.jaxpr_as_fun(known_j))
            n_res = len(unknown_j.jaxpr.invars) - len(unknown_idx)
            apply = jax.jit(C.jaxpr_as_fun(unknown_j), donate_argnums=tuple(
                n_res + j for j, i in enumerate(unknown_idx) if i in donated))
        return _Program(key, closed, folded, report, names, out_tree, full,
                        {"invar_names": names, "const_names": const_names}, known_idx,
                        unknown_idx, prepare, apply, known_j, unknown_j,
                        frozen_refs=tuple(frz_leaves),
                        frozen_copies=tuple((i, np.array(x, copy=True))
                                            for i, x in enumerate(frz_leaves)
                                            if isinstance(x, np.ndarray)),
                        donated=donated)

    def _leaf_name(self, path) -> str:
        if not path:
            return "<arg>"
        head, rest = path[0], path[1:]
        name = getattr(head, "key", None)
        if name is None:
            return jax.tree_util.keystr(path)
        if isinstance(name, str) and name.startswith("#"):
            name = f"args[{name[1:]}]"
        return f"{name}{jax.tree_util.keystr(tuple(rest))}"

    # ---- calling

    def __call__(self, *args, **kwargs):
        prog, leaves = self._program_for(args, kwargs)
        if self._failed and prog.verified is None and any(C.is_tracer(x) for x in leaves) \
                and self._shape_sig(args, kwargs) in self._failed:
            prog.verified = False     # traced calls of a signature that failed verification
        outs = self._call_leaves(prog, leaves)
        if prog.verified is False and self._verify:
            self._failed.add(self._shape_sig(args, kwargs))
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def _shape_sig(self, args, kwargs):
        """Structure, shapes and dtypes of every non-static argument (frozen ones included)
        and the static values: the signature a verify failure applies to, concrete or
        traced."""
        arguments = self._arguments(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(
            {k: v for k, v in arguments.items() if k not in self._static})
        return (tree, tuple((tuple(np.shape(l)), str(getattr(l, "dtype", type(l))))
                            for l in leaves),
                _static_key({k: v for k, v in arguments.items() if k in self._static}))

    def _unfolded(self, prog: _Program) -> Callable:
        if prog.unfolded is None:
            prog.unfolded = jax.jit(C.jaxpr_as_fun(prog.original),
                                    donate_argnums=prog.donated)
        return prog.unfolded

    def _reference(self, prog: _Program) -> Callable:
        """The original program, never donating (verify runs it before the folded one)."""
        if not prog.donated:
            return self._unfolded(prog)
        if prog.reference is None:
            prog.reference = jax.jit(C.jaxpr_as_fun(prog.original))
        return prog.reference

    def _call_leaves(self, prog: _Program, leaves: list) -> list:
        tracing = any(C.is_tracer(x) for x in leaves)
        if prog.verified is False:        # verify=True found the fold wrong for this signature
            if tracing:
                return list(C.jaxpr_as_fun(prog.original)(*leaves))
            return list(self._unfolded(prog)(*leaves))
        if self._verify and prog.verified is None and not tracing:
            ref = list(self._reference(prog)(*leaves))   # first: the folded call may donate
            return self._verify_call(prog, ref, self._call_folded(prog, leaves, tracing))
        return self._call_folded(prog, leaves, tracing)

    def _verify_call(self, prog: _Program, ref: list, outs: list) -> list:
        """Compare the folded outputs with the original program's on these inputs; on a
        mismatch warn and switch this signature to the original program."""
        bad = [(k, why) for k, (r, o) in enumerate(zip(ref, outs))
               if (why := _mismatch(r, o)) is not None]
        prog.verified = not bad
        if not bad:
            return outs
        sites = ", ".join(f"{s.pattern} at {s.location}" for s in prog.report.folded)
        k, why = bad[0]
        warnings.warn(
            f"hlofold: verify: the folded program differs from the original on output {k} "
            f"({why}; {len(bad)} of {len(outs)} outputs differ); folded sites: "
            f"{sites or 'none'}; running the original program for this input signature",
            RuntimeWarning, stacklevel=4)
        return ref

    def _variant(self, prog: _Program, mode: str) -> tuple[C.ClosedJaxpr, FoldReport]:
        """The original program folded with ``in_graph=mode`` (see :func:`fold_jaxpr`)."""
        if mode not in prog.variants:
            prog.variants[mode] = fold_jaxpr(prog.original, **prog.fold_args, in_graph=mode,
                                             float32_kernels=self._float32_kernels)
        return prog.variants[mode]

    def _traced_mode(self) -> str:
        return "guarded" if self.in_graph else "never"

    def _call_folded(self, prog: _Program, leaves: list, tracing: bool) -> list:
        if tracing:
            outs = C.jaxpr_as_fun(self._variant(prog, self._traced_mode())[0])(*leaves)
        elif prog.prepare is None:
            outs = prog.full(*leaves)
        else:
            known = [leaves[i] for i in prog.known_idx]
            prepared = None
            cacheable = self._cache and all(isinstance(k, jax.Array) for k in known)
            if cacheable and prog.cached is not None and len(prog.cached[0]) == len(known) \
                    and all(a is b for a, b in zip(prog.cached[0], known)):
                _check_not_deleted(known)    # as jax.jit: a donated/deleted input raises
                prepared = prog.cached[1]
            if prepared is None:
                prepared, finite = prog.prepare(*known)
                if not bool(finite):
                    # Fail closed: a non-finite folded kernel/bias (s = inf or NaN, e.g.
                    # σ² = 0 with ε = 0) would not reproduce y·s + t. Run the original.
                    warnings.warn(
                        "hlofold: the folded parameters are not finite for these inputs (a "
                        "BatchNorm scale is inf or NaN?); running the unfolded program",
                        RuntimeWarning, stacklevel=4)
                    prepared = _UNFOLDED
                if cacheable:
                    prog.cached = (tuple(known), prepared)
            if prepared is _UNFOLDED:
                outs = self._unfolded(prog)(*leaves)
            else:
                outs = prog.apply(*prepared, *[leaves[i] for i in prog.unknown_idx])
        return list(outs)

    def report(self, *args, **kwargs) -> FoldReport:
        """The fold report for this input signature (direct calls)."""
        return self._program_for(args, kwargs)[0].report

    def traced_report(self, *args, **kwargs) -> FoldReport:
        """What a call under an enclosing transformation (``jax.jit(folded)``) folds, for
        inputs of this signature: sites whose parameters would be traced there are reported
        unfolded with the reason (``in_graph=False``) or guarded in the graph (``True``)."""
        return self._variant(self._program_for(args, kwargs)[0], self._traced_mode())[1]

    def measure_precision(self, *args, **kwargs) -> dict:
        """Error of the unfolded and the folded program against a float32 reference of the
        same network (every bf16/fp16 value carried in float32), on these inputs. The figures
        are also stored in ``report(*args).precision``."""
        from ._precision import measure
        prog, leaves = self._program_for(args, kwargs)
        result = measure(prog.original, lambda *l: self._call_leaves(prog, list(l)), leaves)
        prog.report.precision = result
        return result

    def jaxpr(self, *args, **kwargs) -> C.ClosedJaxpr:
        """The folded jaxpr (inputs: the flattened non-static, non-frozen arguments)."""
        return self._program_for(args, kwargs)[0].folded

    def original_jaxpr(self, *args, **kwargs) -> C.ClosedJaxpr:
        """The jaxpr before folding."""
        return self._program_for(args, kwargs)[0].original

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The folded program, lowered for these args: input parameters are rescaled in the
        graph, each such site guarded at run time (see ``in_graph`` of :func:`fold_jaxpr`)."""
        prog, leaves = self._program_for(args, kwargs)
        return jax.jit(C.jaxpr_as_fun(self._variant(prog, "guarded")[0])).lower(*leaves)

    def split(self, *args, **kwargs) -> Split:
        """The prepare/apply split for this input signature (see :class:`Split`)."""
        prog, _ = self._program_for(args, kwargs)
        if prog.prepare is None:  # nothing to prepare: everything is constant or unfolded
            prog.prepare = _with_finite_flag(lambda: [])
            prog.apply = prog.full
            prog.apply_jaxpr = prog.folded
        return Split([prog.leaf_names[i] for i in prog.known_idx],
                     [prog.leaf_names[i] for i in prog.unknown_idx], prog.prepare_jaxpr,
                     prog.apply_jaxpr, self, prog.key)

    def __repr__(self) -> str:
        return f"<hlofold.fold of {getattr(self._py, '__qualname__', self._py)!r}>"
