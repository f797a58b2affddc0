"""``@hlofold.fold``: the decorator for inference functions.

The decorated function is traced once per input signature (like ``jax.jit``). Parameters
arrive either

* **frozen** (``freeze=``): their values are constants of the traced program; or
* **as inputs**: the inputs a folded site reads (kernels, BatchNorm statistics) are
  *prepared*: bound to their values and folded on the host (:mod:`hlofold._prepare`), the
  result cached on the identity of the (immutable) ``jax.Array`` inputs.

Either way ``K ⊙ s`` and ``t`` are computed once, in float64, with the same safety rules, and
the folded constants are passed to one compiled *apply* program (conv + add) as arguments:
no compile for the prepare step, no weights in the HLO. Steady-state calls check the
arguments' identity and types and run *apply* (a fast path as thin as ``jax.jit``'s).
:meth:`Folded.split` exposes prepare and apply for callers that keep state themselves.

Called under an enclosing transformation with traced parameters, sites are left unfolded by
default (or rescaled in the graph, guarded: ``in_graph=True``); with concrete parameters
(closed over) the prepared program is inlined.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from . import _compat as C
from ._dispatch import (CHURN_LIMIT, MISS, Program, Fast, as_tuple, check_not_deleted, fast_call, frozen_leaf_key,
                        leaf_key, make_fast, same_contents, static_key, trace_struct)
from ._jaxpr.fold import fold_jaxpr
from ._core.reasons import reason_kind
from ._core.tolerance import mismatch
from ._jaxpr.accumulation import accumulation_of
from ._prepare import Executables, fold_with_values, folding_of, place
from ._core.report import FoldReport
from ._views import FoldedViews


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
      cache_prepared: cache the prepared (folded) parameters between calls, keyed on the
        identity of the ``jax.Array`` parameters. With ``False`` every call prepares again
        (useful only for benchmarking; after a few calls the signature then runs the
        original program, as for parameters that change on every call).
      float32_kernels: for bf16/fp16 convolutions, keep the folded kernel in float32 and run
        the convolution in float32 (accuracy over speed). See :meth:`Folded.measure_precision`.
      verify: fail closed. On the first call for each input signature, run the folded and
        the original program on those inputs and compare every output under hlofold's
        tolerance model (:mod:`hlofold._core.tolerance`): NaN and inf at the same places, and
        ``max|Δ| ≤ min(eps·(8 + 2·√L)·(D + 1), 1/8)·max|ref|`` over the finite values,
        with ``L`` the program's longest accumulation and ``D`` its depth in convs/dots;
        non-float outputs exact. This catches a wrong fold (errors of the order of the
        outputs), not rounding; :meth:`Folded.measure_precision` measures that. Past it
        it warns (``RuntimeWarning`` naming the folded sites, ``file:line``) and runs the
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


class Folded(FoldedViews):
    """A folded inference function (see :func:`fold`)."""

    def __init__(self, fun, *, freeze, static_argnums, static_argnames, cache_prepared,
                 float32_kernels=False, verify=False, in_graph=False):
        self._float32_kernels = float32_kernels
        self._verify = verify
        self.in_graph = bool(in_graph)
        ji = C.jit_info(fun)
        self._fun = fun
        self._py = ji[0] if ji else fun
        sa = set(as_tuple(static_argnums)) | set(ji[1] if ji else ())
        sn = set(as_tuple(static_argnames)) | set(ji[2] if ji else ())
        try:
            self._sig = inspect.signature(self._py)
        except (TypeError, ValueError):
            self._sig = None
        self._static = self._to_names(sa | sn, "static")
        self._freeze = self._to_names(set(as_tuple(freeze)), "freeze")
        # donation of a jitted input is kept for the per-call inputs it names
        self._donate = self._to_names(set(ji[3]) | set(ji[4]), "donate") if ji else frozenset()
        self._cache = cache_prepared
        self._programs: dict[Any, Program] = {}
        self._failed: set = set()      # verify=True: signatures whose fold was found wrong
        self._fast: Fast | None = None
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

    def _program_for(self, args, kwargs) -> tuple[Program, list]:
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
        avals = tuple(leaf_key(l) for l in leaves)
        # As strict as jax.jit: static values by type and value, frozen values by pytree
        # structure (dict keys, static fields of modules) and identity or value.
        try:
            frz_key = (jax.tree_util.tree_structure(frozen),
                       tuple(frozen_leaf_key(x) for x in frz_leaves))
            key = (tree, avals, static_key(static), frz_key)
            hash(key)
        except TypeError as e:
            raise TypeError(f"hlofold.fold: static arguments (and the static fields of frozen "
                            f"arguments) must be hashable: {e}") from None
        prog = self._programs.get(key)
        if prog is not None and not same_contents(prog.frozen_copies, frz_leaves):
            prog = None           # a frozen NumPy array was changed in place: fold again
        if prog is None:
            leaves_p = jax.tree_util.tree_flatten_with_path(dynamic)[0]
            prog = self._build(key, arguments, static, frozen, leaves_p, tree, frz_leaves)
            if len(self._programs) > 64:
                self._programs.pop(next(iter(self._programs)))
            self._programs[key] = prog
        return prog, leaves

    def _build(self, key, arguments, static, frozen, leaves_p, tree, frz_leaves) -> Program:
        names = [self._leaf_name(p) for p, _ in leaves_p]
        leaves = [l for _, l in leaves_p]

        def flat_fun(*dyn_leaves):
            dyn = jax.tree_util.tree_unflatten(tree, dyn_leaves)
            merged = {k: (static[k] if k in static else frozen[k] if k in frozen else dyn[k])
                      for k in arguments}
            return self._call_original(merged)

        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(
            *[trace_struct(l) for l in leaves])
        out_tree = jax.tree_util.tree_structure(out_shape)
        frz_p, _ = jax.tree_util.tree_flatten_with_path(frozen)
        by_id = {id(l): self._leaf_name(p) for p, l in frz_p}
        const_names = [by_id.get(id(c)) for c in closed.consts]
        # Which inputs do folded sites read? Those the fold leaves to the graph (unknown
        # parameters); they are folded per value on the host (_prepare).
        folded, found = fold_jaxpr(closed, invar_names=names, const_names=const_names,
                                   float32_kernels=self._float32_kernels, in_graph="never")
        needed = set()
        for s in found.sites:
            if reason_kind(s.reason) == "weights-not-known":
                needed.update(s.params)
                needed.update((s.kernel or "").split(", "))
        known_idx = [i for i, n in enumerate(names) if n in needed]
        unknown_idx = [i for i in range(len(names)) if i not in set(known_idx)]
        donated = tuple(i for i, (p, _) in enumerate(leaves_p)
                        if p and getattr(p[0], "key", None) in self._donate)
        prog = Program(key, closed, names, const_names, out_tree, known_idx, unknown_idx,
                        Executables([j for j, i in enumerate(unknown_idx) if i in donated]),
                        frozen_refs=tuple(frz_leaves),
                        frozen_copies=tuple((i, np.array(x, copy=True))
                                            for i, x in enumerate(frz_leaves)
                                            if isinstance(x, np.ndarray)),
                        donated=donated)
        prog.variants["never"] = (folded, found)    # what traced calls run by default
        if not known_idx:     # nothing to prepare per value: that fold is the final one
            folding = folding_of(folded, found)
            prog.cached = ((), folding, prog.executables.get(folding),
                           place(folding.hoisted, frz_leaves))
        return prog

    def _folding_for(self, prog: Program, known: list, count: bool = True):
        """``(Folding, apply executable, device values)`` for these parameter values: the
        cached ones while the parameters are the same arrays, else folded anew."""
        c = prog.cached
        cacheable = self._cache and all(isinstance(k, jax.Array) for k in known)
        if cacheable and c is not None and len(c[0]) == len(known) \
                and all(a is b for a, b in zip(c[0], known)):
            check_not_deleted(known)    # as jax.jit: a donated/deleted input raises
            prog.hits += count
            return c[1:]
        if count and c is not None:
            prog.churn = prog.churn + 1 if prog.hits < 2 else 0
            prog.churned = prog.churn >= CHURN_LIMIT
        check_not_deleted(known)
        folding = fold_with_values(prog.original, prog.leaf_names, prog.const_names,
                                   prog.known_idx, known,
                                   float32_kernels=self._float32_kernels)
        entry = (folding, prog.executables.get(folding), place(folding.hoisted, known))
        if count or c is None:
            prog.cached, prog.hits = (tuple(known),) + entry, 0
        return entry

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
        fast = self._fast
        if fast is not None and not kwargs:
            outs = fast_call(fast, args)
            if outs is not MISS:
                return outs
        prog, leaves = self._program_for(args, kwargs)
        if self._failed and prog.verified is None and any(C.is_tracer(x) for x in leaves) \
                and self._shape_sig(args, kwargs) in self._failed:
            prog.verified = False     # traced calls of a signature that failed verification
        outs = self._call_leaves(prog, leaves)
        if prog.verified is False and self._verify:
            self._failed.add(self._shape_sig(args, kwargs))
        self._fast = None if kwargs else self._fast_path(prog, args, leaves)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def _fast_path(self, prog: Program, args: tuple, leaves: list) -> Fast | None:
        """The steady-state checks of this signature, or None where a call needs more than
        identity and type checks (static or changed-in-place arguments, pending
        verification, traced inputs)."""
        c = prog.cached
        if (self._static or prog.frozen_copies or prog.churned or c is None
                or (self._verify and prog.verified is not True)
                or any(C.is_tracer(x) for x in leaves)):
            return None
        return make_fast(args, [leaves[i] for i in prog.known_idx], prog.frozen_refs,
                         [leaves[i] for i in prog.unknown_idx], c[2], c[3], prog.out_tree)

    def _shape_sig(self, args, kwargs):
        """Structure, shapes and dtypes of every non-static argument (frozen ones included)
        and the static values: the signature a verify failure applies to, concrete or
        traced."""
        arguments = self._arguments(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(
            {k: v for k, v in arguments.items() if k not in self._static})
        return (tree, tuple((tuple(np.shape(l)), str(getattr(l, "dtype", type(l))))
                            for l in leaves),
                static_key({k: v for k, v in arguments.items() if k in self._static}))

    def _unfolded(self, prog: Program) -> Callable:
        if prog.unfolded is None:
            prog.unfolded = jax.jit(C.jaxpr_as_fun(prog.original),
                                    donate_argnums=prog.donated)
        return prog.unfolded

    def _reference(self, prog: Program) -> Callable:
        """The original program, never donating (verify runs it before the folded one)."""
        if not prog.donated:
            return self._unfolded(prog)
        if prog.reference is None:
            prog.reference = jax.jit(C.jaxpr_as_fun(prog.original))
        return prog.reference

    def _call_leaves(self, prog: Program, leaves: list) -> list:
        tracing = any(C.is_tracer(x) for x in leaves)
        if prog.verified is False:        # verify=True found the fold wrong for this signature
            if tracing:
                return list(C.jaxpr_as_fun(prog.original)(*leaves))
            return list(self._unfolded(prog)(*leaves))
        if self._verify and prog.verified is None and not tracing:
            ref = list(self._reference(prog)(*leaves))   # first: the folded call may donate
            return self._verify_call(prog, ref, self._call_folded(prog, leaves, tracing))
        return self._call_folded(prog, leaves, tracing)

    def _verify_call(self, prog: Program, ref: list, outs: list) -> list:
        """Compare the folded outputs with the original program's on these inputs; on a
        mismatch warn and switch this signature to the original program."""
        acc, depth = accumulation_of(prog.original.jaxpr)
        bad = [(k, why) for k, (r, o) in enumerate(zip(ref, outs))
               if (why := mismatch(r, o, acc, depth)) is not None]
        prog.verified = not bad
        if not bad:
            return outs
        rep = prog.cached[1].report if prog.cached is not None else FoldReport([])
        sites = ", ".join(f"{s.pattern} at {s.location}" for s in rep.folded)
        k, why = bad[0]
        warnings.warn(
            f"hlofold: verify: the folded program differs from the original on output {k} "
            f"({why}; {len(bad)} of {len(outs)} outputs differ); folded sites: "
            f"{sites or 'none'}; running the original program for this input signature",
            RuntimeWarning, stacklevel=4)
        return ref

    def _variant(self, prog: Program, mode: str) -> tuple[C.ClosedJaxpr, FoldReport]:
        """The original program folded with ``in_graph=mode`` (see :func:`fold_jaxpr`)."""
        if mode not in prog.variants:
            prog.variants[mode] = fold_jaxpr(
                prog.original, invar_names=prog.leaf_names, const_names=prog.const_names,
                in_graph=mode, float32_kernels=self._float32_kernels)
        return prog.variants[mode]

    def _traced_mode(self) -> str:
        return "guarded" if self.in_graph else "never"

    def _call_folded(self, prog: Program, leaves: list, tracing: bool) -> list:
        known = [leaves[i] for i in prog.known_idx]
        if any(C.is_tracer(k) for k in known):
            # parameters traced by an enclosing transformation: K·s cannot be prepared
            return list(C.jaxpr_as_fun(self._variant(prog, self._traced_mode())[0])(*leaves))
        if prog.churned:
            if tracing:
                return list(C.jaxpr_as_fun(prog.original)(*leaves))
            return list(self._unfolded(prog)(*leaves))
        _, fn, prepared = self._folding_for(prog, known)
        return list(fn(*prepared, *[leaves[i] for i in prog.unknown_idx]))

    def __repr__(self) -> str:
        name = getattr(self._py, '__qualname__', self._py)
        off = [w for p in self._programs.values() if (w := p.running())]
        if not off:
            return f"<hlofold.fold of {name!r}>"
        return (f"<hlofold.fold of {name!r}: {len(off)} of {len(self._programs)} input "
                f"signatures run {off[0]}>")
