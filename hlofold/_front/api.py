"""``@hlofold.fold``: the decorator for inference functions.

The decorated function is traced once per input signature (like ``jax.jit``). Parameters
arrive either

* **frozen** (``freeze=``): their values are constants of the traced program; or
* **as inputs**: the inputs a folded site reads (kernels, BatchNorm statistics) are
  *prepared*: bound to their values and folded on the host (:mod:`hlofold._front.prepare`), the
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
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hlofold import _compat as C
from .dispatch import (CHURN_LIMIT, MISS, Fast, Program, as_tuple, check_not_deleted, fast_call,
                       frozen_leaf_key, leaf_key, make_fast, same_contents, static_key,
                       trace_struct, verify_outputs)
from hlofold._fold.jaxpr.fold import fold_jaxpr
from hlofold._base.reasons import reason_kind
from .prepare import Executables, device_entry, fold_with_values, folding_of, on_device, place
from hlofold._base.report import FoldReport
from .signature import Signature
from .views import FoldedViews


def fold(fun: Callable | None = None, *, freeze: int | str | Sequence[int | str] = (),
         static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
         cache_prepared: bool = True, float32_kernels: bool = False, verify: bool | None = None,
         in_graph: bool = False, fold_costly: bool = False, prepare: str = "auto",
         merge: bool = True):
    """Fold every BatchNorm (per-channel affine) after a convolution in ``fun``.

    Args:
      fun: an inference function, plain or already ``jax.jit``-ed (its static arguments are
        respected).
      freeze: argument numbers or names whose values are baked into the program as
        constants (like ``torch.jit.freeze``). A different array passed later re-freezes.
      static_argnums, static_argnames: as for ``jax.jit`` (for a plain ``fun``).
      cache_prepared: cache the prepared parameters between calls, keyed on the identity of
        the ``jax.Array`` parameters (``False``: prepare on every call, for benchmarks).
      float32_kernels: for bf16/fp16 convolutions, keep the folded kernel in float32 and run
        the convolution in float32 (accuracy over speed). See :meth:`Folded.measure_precision`.
      verify: fail closed. On the first call for each input signature, run the folded and
        the original program on those inputs and compare every output under hlofold's
        tolerance model (:mod:`hlofold._base.tolerance`): NaN and inf at the same places, and
        ``max|Δ| ≤ min(eps·(8 + 2·√L)·(D + 1), 1/8)·max|ref|`` over the finite values,
        with ``L`` the program's longest accumulation and ``D`` its depth in convs/dots;
        non-float outputs exact. This catches a wrong fold (errors of the order of the
        outputs), not rounding; :meth:`Folded.measure_precision` measures that. Past it
        it warns (``RuntimeWarning`` naming the folded sites, ``file:line``) and runs the
        original program for that signature from then on. Calls whose inputs are tracers
        (under an enclosing transformation) are not verified. ``None`` (default): ``False``
        on the JAX releases hlofold is tested with (``hlofold._compat.TESTED``), ``True`` on
        a newer JAX — there, too, a fold that needs a JAX internal that changed is off and
        the call runs the original program (the report says which change).
      in_graph: what a call under an enclosing transformation (``jax.jit(fold(f))``,
        ``vmap``) does with sites whose parameters are traced (``K ⊙ s`` would run on every
        call). ``False`` (default): leave them unfolded, the original program, never slower;
        :meth:`traced_report` says so per site (to fold under your own jit, prepare outside
        it: :meth:`split`). ``True``: rescale in the graph, each site guarded at run time (a
        non-finite folded kernel or bias runs the original equations; fp16/fp8 kernels stay).
      fold_costly: fold sites the cost rule leaves. By default a site whose parameters are
        inputs folds only where its fold removes a pass over a tensor (a BatchNorm after a
        conv or dense layer, an affine pass of its own in front of one): a LayerNorm/RMSNorm
        γ folded into the projections reading it removes only multiplies inside the pass
        computing ``x·r`` and would hold a folded copy of each kernel beside the parameters.
        Such sites are reported ``left``, with their figures (``hlofold._fold.core.cost``).
        Frozen parameters and :func:`hlofold.fold_params` fold them regardless.
      prepare: where the parameters a folded site reads are prepared (``K ⊙ s``, the
        bias): ``"auto"`` (default) on the host for parameters on one CPU device (no
        compile), on their own devices otherwise — sharded, spanning processes, or on an
        accelerator: one compiled program per signature, nothing gathered, the results in
        the parameters' sharding; ``"host"`` or ``"device"`` to choose.
      merge: sums of parallel branches become one convolution (docs/folds.md); ``False``: kept.

    Returns a :class:`Folded` callable with ``.lower``, ``.report``, ``.jaxpr`` and ``.split``.
    """
    if fun is None:
        return functools.partial(fold, freeze=freeze, static_argnums=static_argnums,
                                 static_argnames=static_argnames, cache_prepared=cache_prepared,
                                 float32_kernels=float32_kernels, verify=verify,
                                 in_graph=in_graph, fold_costly=fold_costly, prepare=prepare,
                                 merge=merge)
    return Folded(fun, freeze=freeze, static_argnums=static_argnums,
                  static_argnames=static_argnames, cache_prepared=cache_prepared,
                  float32_kernels=float32_kernels, verify=verify, in_graph=in_graph,
                  fold_costly=fold_costly, prepare=prepare, merge=merge)


class Folded(FoldedViews):
    """A folded inference function (see :func:`fold`)."""

    def __init__(self, fun, *, freeze, static_argnums, static_argnames, cache_prepared,
                 float32_kernels=False, verify=None, in_graph=False, fold_costly=False,
                 prepare="auto", merge=True):
        if prepare not in ("auto", "host", "device"):
            raise ValueError(f"hlofold.fold: prepare must be 'auto', 'host' or 'device', "
                             f"got {prepare!r}")
        self._prepare = prepare
        self._float32_kernels = float32_kernels
        self._merge = bool(merge)
        self._cost = None if fold_costly else frozenset()     # the cost rule (_fold.core.cost)
        self._verify = C.untested() if verify is None else bool(verify)
        self.in_graph = bool(in_graph)
        # fail closed: where this JAX changed what the jaxpr path reads, every call runs
        # the original program (jax.jit of it), and report() says why
        self._off = C.disabled("jaxpr")
        try:
            ji = None if self._off else C.jit_info(fun)
        except C.CompatError as e:
            self._off, ji = e, None
        if self._off is not None:
            self._original = fun if hasattr(fun, "lower") else jax.jit(
                fun, static_argnums=static_argnums, static_argnames=static_argnames)
        self._fun = fun
        self._py = ji[0] if ji else fun
        # compiler_options hold at the top level only: every program compiled here takes them
        self._options = (ji[5] or None) if ji else None
        self.signature = Signature(self._py if self._options else fun, self._py)
        sa = set(as_tuple(static_argnums)) | set(ji[1] if ji else ())
        sn = set(as_tuple(static_argnames)) | set(ji[2] if ji else ())
        self._static = self.signature.names(sa | sn, "static")
        self.frozen = self.signature.names(set(as_tuple(freeze)), "freeze")
        # donation of a jitted input is kept for the per-call inputs it names
        self._donate = self.signature.names(set(ji[3]) | set(ji[4]), "donate") if ji \
            else frozenset()
        self._cache = cache_prepared
        self._reset_caches()
        functools.update_wrapper(self, self._py)
        self.__wrapped__ = fun        # the function as given (jitted or not)

    def _reset_caches(self):
        """Per-signature programs, prepared values and the fast path: shared by the threads
        that call this function; built and changed under ``_lock``, read without it (the
        fast path is one object, replaced whole)."""
        self._lock = threading.RLock()
        self._programs: dict[Any, Program] = {}
        self._failed: set = set()      # verify=True: signatures whose fold was found wrong
        self._fast: Fast | None = None

    # ---- copies: caches are per object (traced programs hold tracebacks, which do not
    # pickle; a copy folds again on its first call)

    _CACHES = ("_lock", "_programs", "_failed", "_fast")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._CACHES}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_caches()

    # ---- programs

    def _program_for(self, args, kwargs) -> tuple[Program, list]:
        if self._off is not None:
            raise self._off
        arguments = self.signature.bind(args, kwargs)
        static = {k: v for k, v in arguments.items() if k in self._static}
        frozen = {k: v for k, v in arguments.items() if k in self.frozen}
        dynamic = {k: v for k, v in arguments.items() if k not in self._static
                   and k not in self.frozen}
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        frz_leaves = jax.tree_util.tree_leaves(frozen)
        if any(C.is_tracer(x) or (isinstance(x, jax.Array) and not x.is_fully_addressable)
               for x in frz_leaves):
            # Frozen values that are tracers, or arrays no process holds whole, cannot be
            # baked in: treat them as inputs (prepared where they live).
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
            # (x64 decides how NumPy and Python inputs are typed, as in jax.jit's key)
            key = (tree, avals, static_key(static), frz_key, jax.config.jax_enable_x64)
            hash(key)
        except TypeError as e:
            raise TypeError(f"hlofold.fold: static arguments (and the static fields of frozen "
                            f"arguments) must be hashable: {e}") from None
        with self._lock:
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
        names = [self.signature.leaf_name(p) for p, _ in leaves_p]
        leaves = [l for _, l in leaves_p]
        # frozen NumPy arrays are traced as hlofold's own copies (kept to see an in-place
        # change): JAX caches device buffers of a jaxpr's constants by the array, so the
        # user's own arrays would carry this trace's typing (float64 under x64) into their
        # later jax.jit calls once x64 is off
        copies = {i: np.array(x, copy=True) for i, x in enumerate(frz_leaves)
                  if isinstance(x, np.ndarray)}
        if copies:
            frz_tree = jax.tree_util.tree_structure(frozen)
            frozen = jax.tree_util.tree_unflatten(
                frz_tree, [copies.get(i, x) for i, x in enumerate(frz_leaves)])

        out_trees = []
        order = tuple(arguments)         # (names only: the traced program, kept for the
        # fallbacks, must not hold this call's inputs alive)

        def flat_fun(*dyn_leaves):       # flat leaves in, flat leaves out
            dyn = jax.tree_util.tree_unflatten(tree, dyn_leaves)
            merged = {k: (static[k] if k in static else frozen[k] if k in frozen else dyn[k])
                      for k in order}
            outs, out_tree = jax.tree_util.tree_flatten(self.signature.call(merged))
            out_trees.append(out_tree)
            return outs

        donated = tuple(i for i, (p, _) in enumerate(leaves_p)
                        if p and getattr(p[0], "key", None) in self._donate)
        # one trace, as jax.jit's: the program runs as this jit where nothing folds
        plain = jax.jit(flat_fun, donate_argnums=donated, compiler_options=self._options)
        traced = plain.trace(*[trace_struct(l) for l in leaves])
        closed, out_tree = traced.jaxpr, out_trees[-1]
        frz_p, _ = jax.tree_util.tree_flatten_with_path(frozen)
        by_id = {id(l): self.signature.leaf_name(p) for p, l in frz_p}
        const_names = [by_id.get(id(c)) for c in closed.consts]
        # Which inputs do folded sites read? Those the fold leaves to the graph (unknown
        # parameters); they are folded per value on the host (_prepare).
        folded, found = fold_jaxpr(closed, invar_names=names, const_names=const_names,
                                   float32_kernels=self._float32_kernels, in_graph="never",
                                   merge=self._merge, cost=self._cost)
        needed = set()
        for s in found.sites:
            if reason_kind(s.reason) == "weights-not-known":
                needed.update(s.params)
                needed.update((s.kernel or "").split(", "))
        known_idx = [i for i, n in enumerate(names) if n in needed]
        unknown_idx = [i for i in range(len(names)) if i not in set(known_idx)]
        prog = Program(key, closed, names, const_names, out_tree, known_idx, unknown_idx,
                        Executables([j for j, i in enumerate(unknown_idx) if i in donated],
                                    self._options),
                        frozen_refs=tuple(frz_leaves),
                        frozen_copies=tuple(copies.items()),
                        donated=donated, options=self._options)
        prog.variants["never"] = (folded, found)    # what traced calls run by default
        if not known_idx and not C.in_manual_context():
            # nothing to prepare per value: that fold is the final one (inside shard_map its
            # constants cannot be placed: each call folds, see _folding_for)
            folding = folding_of(folded, found)
            # nothing folded and nothing frozen: the user's program as jax.jit compiles it
            # (its trace reused); frozen arrays stay arguments (no weights in the HLO)
            same = folded is closed and not folding.hoisted
            prog.cached = ((), folding, plain, []) if same else (
                (), folding, prog.executables.get(folding), place(folding.hoisted, frz_leaves))
        prog.unfolded = plain          # the original program (fallbacks), traced already
        return prog

    def _folding_for(self, prog: Program, known: list, count: bool = True):
        """``(Folding, apply executable, device values)`` for these parameter values: the
        cached ones while the parameters are the same arrays, else folded anew. Safe under
        concurrent calls: the entry returned is the one these values were folded to, also
        when another thread caches another meanwhile."""
        with self._lock:
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
            manual = C.in_manual_context()    # inside shard_map: constants of its trace
            if not manual and (self._prepare == "device" or
                               (self._prepare == "auto" and on_device(known))):
                entry = device_entry(prog, known, float32_kernels=self._float32_kernels,
                                     merge=self._merge, cost=self._cost is not None)
            else:
                folding = fold_with_values(prog.original, prog.leaf_names, prog.const_names,
                                           prog.known_idx, known,
                                           float32_kernels=self._float32_kernels,
                                           merge=self._merge, cost=self._cost is not None)
                entry = (folding, prog.executables.get(folding),
                         list(folding.hoisted) if manual else place(folding.hoisted, known))
            if (count or c is None) and not manual:
                prog.cached, prog.hits = (tuple(known),) + entry, 0
            return entry

    # ---- calling

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None and not kwargs:
            outs = fast_call(fast, args)
            if outs is not MISS:
                return outs
        if self._off is not None:
            return self._original(*args, **kwargs)
        prog, leaves = self._program_for(args, kwargs)
        if self._failed and prog.verified is None and any(C.is_tracer(x) for x in leaves) \
                and self._shape_sig(args, kwargs) in self._failed:
            prog.verified = False     # traced calls of a signature that failed verification
        outs, entry = self._call_leaves(prog, leaves)
        if prog.verified is False and self._verify:
            with self._lock:
                self._failed.add(self._shape_sig(args, kwargs))
        if kwargs:
            self._fast = None
        elif entry is not None:
            self._fast = self._fast_path(prog, args, leaves, entry)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def _fast_path(self, prog: Program, args: tuple, leaves: list, entry) -> Fast | None:
        """The steady-state checks of this signature for the prepared values ``entry`` this
        call ran with, or None where a call needs more than identity and type checks
        (static or changed-in-place arguments, pending verification, traced inputs)."""
        if (self._static or prog.frozen_copies or prog.churned or (self._verify and
                prog.verified is not True) or any(C.is_tracer(x) for x in leaves)):
            return None
        folding, fn, prepared = entry
        return make_fast(args, [leaves[i] for i in prog.known_idx], prog.frozen_refs,
                         [leaves[i] for i in prog.unknown_idx], fn, prepared, prog.out_tree,
                         bool(prog.options or folding.report.compile_options))

    def _shape_sig(self, args, kwargs):
        return self.signature.shape_key(self.signature.bind(args, kwargs), self._static,
                                        static_key)

    def _call_leaves(self, prog: Program, leaves: list) -> tuple[list, Any]:
        """The outputs of one call, and the prepared entry it ran with (None: it ran
        another program: the original, an in-graph variant, or a verification)."""
        tracing = any(C.is_tracer(x) for x in leaves)
        if prog.verified is False:        # verify=True found the fold wrong for this signature
            if tracing:
                return list(C.jaxpr_as_fun(prog.original)(*leaves)), None
            return list(prog.original_fn()(*leaves)), None
        if self._verify and prog.verified is None and not tracing:
            if prog.original.effects:
                # comparing would run the program's side effects (callbacks, I/O) twice
                prog.verified = True
                warnings.warn(
                    "hlofold: verify=True: this program has side effects ("
                    + ", ".join(sorted(str(e) for e in prog.original.effects)) +
                    "); running it twice to compare would repeat them, so its fold is not "
                    "verified", RuntimeWarning, stacklevel=4)
                return self._call_folded(prog, leaves, tracing)
            ref = list(prog.reference_fn()(*leaves))   # first: the folded call may donate
            outs, _ = self._call_folded(prog, leaves, tracing)
            return verify_outputs(prog, ref, outs), None
        return self._call_folded(prog, leaves, tracing)

    def _variant(self, prog: Program, mode: str) -> tuple[C.ClosedJaxpr, FoldReport]:
        """The original program folded with ``in_graph=mode`` (see :func:`fold_jaxpr`)."""
        with self._lock:
            if mode not in prog.variants:
                prog.variants[mode] = fold_jaxpr(
                    prog.original, invar_names=prog.leaf_names,
                    const_names=prog.const_names, in_graph=mode,
                    float32_kernels=self._float32_kernels, cost=self._cost,
                    merge=self._merge)
            return prog.variants[mode]

    def _traced_mode(self) -> str:
        return "guarded" if self.in_graph else "never"

    def _call_folded(self, prog: Program, leaves: list, tracing: bool) -> tuple[list, Any]:
        known = [leaves[i] for i in prog.known_idx]
        if any(C.is_tracer(k) for k in known):
            # parameters traced by an enclosing transformation: K·s cannot be prepared
            return list(C.jaxpr_as_fun(self._variant(prog, self._traced_mode())[0])(
                *leaves)), None
        if prog.churned or prog.compat:
            if tracing and not prog.compat:
                return list(C.jaxpr_as_fun(prog.original)(*leaves)), None
            return list(prog.original_fn()(*leaves)), None
        try:
            entry = self._folding_for(prog, known)
        except Exception as e:        # preparing needs an internal this JAX changed
            err = C.as_compat(e)
            if err is None:
                raise
            prog.compat = f"the original program ({err})"
            return list(prog.original_fn()(*leaves)), None
        folding, fn, prepared = entry
        if tracing and (prog.options or folding.report.compile_options):
            fn = fn.__wrapped__     # inlined: a nested jit cannot take compile options
        return list(fn(*prepared, *[leaves[i] for i in prog.unknown_idx])), entry
