"""The jaxpr folder.

``fold_jaxpr`` walks a closed jaxpr. For every root equation that a pattern is registered for
(``conv_general_dilated``), it follows the root's output through a chain of per-output-channel
affine operations, collapsing them algebraically into a running ``y·s + t``:

    add c: t += c      sub c: t -= c      c - y: s, t = -s, c - t
    mul c: s, t = s·c, t·c      div c: s, t = s/c, t/c      neg: s, t = -s, -t

then rewrites the chain to ``conv(x, K ⊙ s) + broadcast_in_dim(t)``. ``K ⊙ s`` scales the
kernel along its output-feature dimension, which is exact for any rank, stride, padding,
dilation (lhs dilation included) and feature/batch grouping.

The rewrite is *planned* first, outside any trace (constants are evaluated eagerly there, so
``K ⊙ s`` of constant parameters is computed once, in float64 on the host), and then the program
is *retraced* with ``jax.make_jaxpr`` of an interpreter that replays every equation and emits
the folded form at the end of each chain. Nested jaxprs (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``, ``closed_call``, ``cond`` branches, ``scan`` and ``while``
bodies) are folded recursively, with known (constant) inputs followed into them.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

from . import _compat as C
from ._patterns import (PATTERNS, FORWARD, AFFINE_STEPS, PASS_STEPS, AffineStep, ChannelOperand,
                        PassStep, Refusal, RootInfo, affine_step, pass_step)
from ._report import (CANONICAL, FOLDED, NO_PATTERN, NOT_REACHED, REFUSED, FoldReport,
                      FoldSite)
from ._unreached import unreached_reason
from ._host import evaluate as host_evaluate
from ._rules import precision_refusal, round_kernel, runtime_refusal, scale_refusal

# Largest constant sub-computation evaluated at transform time (elements per output).
_MAX_CONST_EVAL = 1 << 26
_REMAT_NAMES = frozenset({"checkpoint", "remat", "remat2"})
_CALL_NAMES = C.JIT_NAMES | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


def fold_jaxpr(closed: C.ClosedJaxpr, *, invar_names: Sequence[str] | None = None,
               const_names: Sequence[str] | None = None,
               float32_kernels: bool = False,
               in_graph: str = "guarded") -> tuple[C.ClosedJaxpr, FoldReport]:
    """Fold every conv → per-channel-affine chain of ``closed``.

    Args:
      closed: the program, e.g. ``jax.make_jaxpr(f)(*args)``.
      invar_names: optional names of the inputs (e.g. pytree paths); the report uses them to
        say which inputs each folded site absorbed.
      const_names: the same for ``closed.consts``.
      float32_kernels: keep folded kernels of bf16/fp16 convolutions in float32 and run those
        convolutions in float32 (more accurate, slower); by default ``K ⊙ s`` is computed in
        float32 (float64 for constants) and rounded once to the kernel dtype.
      in_graph: what to do with a site whose parameters are not known at transform time, so
        that ``K ⊙ s`` has to be computed in the program:

        * ``"guarded"`` (default): fold, and guard the site at run time — when the rescaled
          kernel or the bias is not finite (σ² = 0 with ε = 0, an inf γ, an overflow), the
          site runs its original equations instead. Kernels of a narrower range than
          float32 (fp16, fp8) are refused: their rounding cannot be checked in the graph.
        * ``"prepared"``: fold without a guard; the caller computes the parameter-only part
          once and checks it (what :func:`hlofold.fold` does with its prepare step).
        * ``"never"``: leave such sites unfolded (reported with the reason). The rescale
          would run on every call, which costs more than it saves where the backend already
          fuses the BatchNorm epilogue into the convolution (XLA:CPU).

    Returns ``(folded, report)``. ``folded`` has the same inputs and outputs as ``closed``;
    when nothing folds it *is* ``closed``.
    """
    if in_graph not in IN_GRAPH_MODES:
        raise ValueError(f"in_graph must be one of {IN_GRAPH_MODES}, got {in_graph!r}")
    if isinstance(closed, C.Jaxpr):
        closed = C.ClosedJaxpr(closed, ())
    if not isinstance(closed, C.ClosedJaxpr):
        raise TypeError(f"fold_jaxpr expects a ClosedJaxpr (from jax.make_jaxpr), got "
                        f"{type(closed).__name__}")
    n_in = len(closed.jaxpr.invars)
    names = list(invar_names) if invar_names is not None else [f"arg{i}" for i in range(n_in)]
    if len(names) != n_in:
        raise ValueError(f"invar_names has {len(names)} entries for {n_in} inputs")
    cnames = list(const_names) if const_names is not None else [None] * len(closed.consts)
    sites: list[FoldSite] = []
    scope = _Scope(closed,
                   known_in=[_NONE] * n_in,
                   names_in=[_const(frozenset({n})) for n in names],
                   const_names=cnames, path="top", sites=sites,
                   opts=_Options(float32_kernels=float32_kernels, in_graph=in_graph))
    return scope.fold(), FoldReport(sites)


IN_GRAPH_MODES = ("guarded", "prepared", "never")
# name scope of the run-time guard of a site (a ``cond``: folded | original equations); a
# guard is already folded, so folding again leaves it alone (idempotence)
GUARD_SCOPE = "hlofold_guard"
NOT_PREPARED = ("the parameters are not known at transform time (traced under an enclosing "
                "transformation), so K·s would be recomputed on every call; left unfolded — "
                "prepare outside your jit (Folded.split) or pass in_graph=True")


def _not_prepared(kernel, out) -> str:
    """The reason a site with traced parameters stays unfolded, with what folding it in the
    graph would trade: |K| rescaled (and range-checked) per call against the epilogue over
    the output it removes, which XLA:CPU already fuses into the convolution."""
    def size(aval) -> str:          # symbolic dimensions (jax.export) print as they are
        n = 1
        for d in aval.shape:
            n = n * d
        return str(n)
    return (f"{NOT_PREPARED} (in the graph: {size(kernel.aval)} kernel elements rescaled and "
            f"checked per call, to remove an epilogue over {size(out.aval)} output elements)")


@dataclasses.dataclass(frozen=True)
class _Options:
    float32_kernels: bool = False
    in_graph: str = "guarded"


# sites of equal plans are traced once and cloned (tests turn it off to compare with a trace
# per site)
CLONE_TEMPLATES = True
# plan fields that say where a site is or what is reported of it, not what it computes
_NOT_PLAN = frozenset({"root_idx", "end_idx", "record", "t_traced"})


def _NONE():
    return None


def _const(v):
    return lambda: v


# --------------------------------------------------------------------------- plan


@dataclasses.dataclass
class _Site:
    root_idx: int
    eqn: C.JaxprEqn
    info: RootInfo
    steps: list                      # AffineStep | PassStep, ending with an AffineStep
    end_idx: int
    end_var: Any
    end_axis: int
    record: FoldSite
    kernel_const: np.ndarray | None = None     # folded kernel, when computed at transform time
    s_known: np.ndarray | None = None          # float64 s, when known at transform time
    t_known: np.ndarray | None = None
    has_shift: bool = False
    t_traced: Any = None                       # t computed in the graph (set while emitting)
    fwd: "_Forward | None" = None              # affine folded in from *before* the root
    guard: bool = False                        # run-time check, original equations as fallback


@dataclasses.dataclass
class _Forward:
    """An affine chain in front of the root: ``root(x·s + t, K) = root(x, K ⊙ s) + b``."""

    steps: list                  # AffineSteps, in program order
    source: Any                  # x: the value before the chain
    k_in_axis: int               # kernel axis contracted with the input features
    groups: int
    record: FoldSite
    s_known: np.ndarray | None = None
    t_known: np.ndarray | None = None

    @property
    def has_shift(self) -> bool:
        return any(s.kind in ("add", "sub", "rsub") for s in self.steps)


class _Scope:
    """Planning and emission for one (closed) jaxpr."""

    def __init__(self, closed: C.ClosedJaxpr, known_in: list[Callable], names_in: list[Callable],
                 const_names: list, path: str, sites: list[FoldSite], opts: "_Options"):
        self.opts = opts
        self.closed = closed
        self.jaxpr = closed.jaxpr
        self.path = path
        self.sites = sites
        self.known: dict[Any, Any] = {}
        self.known_thunks: dict[Any, Callable] = dict(zip(self.jaxpr.invars, known_in))
        self.name_thunks: dict[Any, Callable] = dict(zip(self.jaxpr.invars, names_in))
        self.origins: dict[Any, frozenset] = {}
        self.activation: dict[Any, bool] = {}
        for v, val, nm in zip(self.jaxpr.constvars, closed.consts, const_names):
            self.known[v] = val
            self.origins[v] = frozenset({nm}) if nm else frozenset()
        self.producer: dict[Any, tuple[int, C.JaxprEqn]] = {}
        self.uses: dict[Any, list[tuple[int, int]]] = {}
        self.out_uses: dict[Any, int] = {}
        for i, eqn in enumerate(self.jaxpr.eqns):
            for pos, v in enumerate(eqn.invars):
                if isinstance(v, C.Var):
                    self.uses.setdefault(v, []).append((i, pos))
            for v in eqn.outvars:
                self.producer[v] = (i, eqn)
        for v in self.jaxpr.outvars:
            if isinstance(v, C.Var):
                self.out_uses[v] = self.out_uses.get(v, 0) + 1
        self.site_at_end: dict[int, _Site] = {}
        self.skip: set[int] = set()
        # equations on the backward chain of an earlier root (folded or canonical): a later
        # root's forward chain must not take them (one op, one owner)
        self.claimed: set[int] = set()
        self.forward_taken: set[int] = set()     # equations of forward chains (any status)
        self.new_eqn: dict[int, tuple[dict, Callable]] = {}

    # ---- known values and provenance (memoized, iterative: programs can be deep)

    def _backward(self, atom, memo: dict, literal, leaf, combine):
        """Memoized walk from ``atom`` back to the inputs: ``leaf(v)`` gives the value of a
        variable without a producer in this scope,
        ``combine(eqn, input_values)`` the values of an equation's outputs."""
        if isinstance(atom, C.Literal):
            return literal(atom)
        stack = [atom]
        while stack:
            v = stack[-1]
            if v in memo:
                stack.pop()
                continue
            prod = self.producer.get(v)
            if prod is None:
                memo[v] = leaf(v)
                stack.pop()
                continue
            eqn = prod[1]
            missing = [u for u in eqn.invars if isinstance(u, C.Var) and u not in memo]
            if missing:
                stack.extend(missing)
                continue
            ins = [literal(u) if isinstance(u, C.Literal) else memo[u] for u in eqn.invars]
            for o, val in zip(eqn.outvars, combine(eqn, ins)):
                memo[o] = val
            stack.pop()
        return memo[atom]

    def value(self, atom) -> Any:
        """Concrete value of ``atom`` if it is known at transform time, else None."""
        def leaf(v):
            return self.known_thunks[v]() if v in self.known_thunks else None

        def combine(eqn, vals):
            if all(x is not None for x in vals) and _evaluable(eqn):
                out = host_evaluate(eqn, vals)      # NumPy: no XLA compile per op
                if out is not None:
                    return out
                with jax.ensure_compile_time_eval():
                    return C.bind_eqn(eqn, vals)
            return [None] * len(eqn.outvars)
        return self._backward(atom, self.known, lambda a: a.val, leaf, combine)

    def names(self, atom) -> frozenset:
        """Names of the program inputs (or named constants) that ``atom`` derives from."""
        def leaf(v):
            return self.name_thunks[v]() if v in self.name_thunks else frozenset()

        def combine(eqn, vals):
            return [frozenset().union(*vals)] * len(eqn.outvars)
        return self._backward(atom, self.origins, lambda a: frozenset(), leaf, combine)

    def from_root(self, atom) -> bool:
        """Whether ``atom`` is computed from the output of a pattern root (a convolution),
        directly or through nested jaxprs: then it is an activation, never a parameter."""
        def combine(eqn, vals):
            act = eqn.primitive.name in PATTERNS or any(vals) or _contains_root(eqn)
            return [act] * len(eqn.outvars)
        return self._backward(atom, self.activation, lambda a: False, lambda v: False, combine)

    # ---- planning

    def fold(self) -> C.ClosedJaxpr:
        first = len(self.sites)
        changed = False
        for i, eqn in enumerate(self.jaxpr.eqns):
            pattern = PATTERNS.get(eqn.primitive.name)
            if pattern is not None:
                # transform-time arithmetic on hostile values (σ² = 0, inf, NaN) is checked
                # explicitly (refusals name it); NumPy's own warnings would only be noise
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    changed |= self._plan_site(i, eqn, pattern)
            elif is_guard(eqn):         # an already folded site: reported, never changed
                branch = C.cond_branches(eqn)[1]
                self._child(branch, eqn.invars[1:], [False] * len(branch.jaxpr.invars),
                            "guard")
            elif _contains_root(eqn):       # nested jaxprs without a root are left as they are
                changed |= self._plan_nested(i, eqn)
        self._account_unreached()
        if not changed:
            return self.closed
        try:
            return _dce(self._emit())
        except Exception as e:     # fail closed: this scope runs as written, and says why
            for rec in self.sites[first:]:
                if rec.status == FOLDED:
                    rec.status = REFUSED
                    rec.reason = (f"hlofold could not rewrite this part of the program "
                                  f"({type(e).__name__}: {e}); it runs unfolded — please "
                                  "report this")
            warnings.warn(f"hlofold: a scope of the program is left unfolded after an "
                          f"internal error ({type(e).__name__}: {e})", RuntimeWarning,
                          stacklevel=2)
            return self.closed

    def _account_unreached(self) -> None:
        """A NOT_REACHED record for each ``mul`` of an activation by a per-channel vector of
        parameters that no root's chain took (see :mod:`hlofold._unreached`)."""
        producer = lambda u: self.producer.get(u, (0, None))[1]
        taken = self.claimed | self.forward_taken
        for j, e in enumerate(self.jaxpr.eqns):
            if e.primitive.name != "mul" or j in taken:
                continue
            for pos in (0, 1):
                x = e.invars[pos]
                if not isinstance(x, C.Var) or len(x.aval.shape) < 2 or not self.from_root(x):
                    continue
                step = next((r for r in (affine_step(e, pos, a, producer)
                                         for a in range(len(x.aval.shape))
                                         if x.aval.shape[a] != 1)
                             if isinstance(r, AffineStep) and r.operand is not None
                             and r.operand.size > 1
                             and not self.from_root(r.operand.source)), None)
                if step is None:
                    continue
                after = self._before_chain(x)
                if after in PATTERNS:        # the root's own record accounts for it
                    break
                uses = self.uses.get(e.outvars[0], [])
                then = ("output" if self.out_uses.get(e.outvars[0]) or not uses else
                        self.jaxpr.eqns[uses[0][0]].primitive.name)
                file, line, fn = C.user_location(e)
                self.sites.append(FoldSite(
                    pattern="unreached_affine", primitive="mul", status=NOT_REACHED,
                    scope=self.path, file=file, line=line, function=fn,
                    name_stack=C.name_stack(e), dtype=str(e.outvars[0].aval.dtype),
                    out_channels=step.operand.size,
                    params=sorted(n for n in self.names(step.operand.source) if n),
                    reason=unreached_reason(after, then)))
                break

    def _before_chain(self, v) -> str:
        """The primitive before the per-channel arithmetic and shape ops leading to ``v``
        ("input" at the scope's input)."""
        while isinstance(v, C.Var) and v in self.producer:
            e = self.producer[v][1]
            name = e.primitive.name
            acts = [u for u in e.invars if isinstance(u, C.Var) and self.from_root(u)]
            if len(acts) == 1 and (name in PASS_STEPS or name in AFFINE_STEPS):
                v = acts[0]          # through shape ops and arithmetic with parameters
                continue
            return name
        return "input"

    def _record(self, eqn, pattern, info, status, **kw) -> FoldSite:
        file, line, fn = C.user_location(eqn)
        rec = FoldSite(pattern=pattern.name, primitive=eqn.primitive.name, status=status,
                       scope=self.path, file=file, line=line, function=fn,
                       name_stack=C.name_stack(eqn),
                       dtype=str(eqn.outvars[0].aval.dtype), **kw)
        if isinstance(info, RootInfo):
            rec.layout = info.layout
            rec.in_channels, rec.out_channels, rec.groups = (info.in_channels,
                                                             info.out_channels, info.groups)
        self.sites.append(rec)
        return rec

    def _walk(self, eqn, info: RootInfo, pattern):
        """Follow the root's output through the chain; return (steps, end_axis, stop_reason,
        stop_is_refusal). ``steps`` ends with the last absorbable affine op."""
        v, axis = eqn.outvars[0], info.channel_axis
        steps: list = []
        committed, committed_axis = 0, axis
        reason, refusal = None, False
        while True:
            uses = self.uses.get(v, [])
            n_out = self.out_uses.get(v, 0)
            n = len(uses) + n_out
            if n == 0:
                reason = "value is unused"
                break
            if n > 1:
                who = [self.jaxpr.eqns[j].primitive.name for j, _ in uses] + ["output"] * n_out
                what = "the conv output" if v is eqn.outvars[0] else f"{_desc(v)} in the chain"
                reason = f"{what} has {n} consumers ({', '.join(who)}); folding would change them"
                refusal = True
                break
            if n_out:
                reason = f"value is an output of the {self.path} program"
                break
            j, pos = uses[0]
            e = self.jaxpr.eqns[j]
            prim = e.primitive.name
            if prim in AFFINE_STEPS:
                r = affine_step(e, pos, axis, lambda u: self.producer.get(u, (0, None))[1])
                if isinstance(r, Refusal):
                    reason, refusal = r.reason, True
                    if r.axis is not None and v is eqn.outvars[0]:
                        reason += f"; axis {r.axis} is {pattern.explain_axis(eqn, r.axis)}"
                    break
                if r.operand is not None and self.from_root(r.operand.source):
                    reason = (f"{prim}: operand is computed from a convolution output (a "
                              "residual or a gate), not from parameters")
                    refusal = True
                    break
                steps.append(r)
                committed, committed_axis = len(steps), axis
            elif prim in PASS_STEPS and pos == 0:
                r = pass_step(e, axis)
                if isinstance(r, Refusal):
                    reason = r.reason
                    break
                steps.append(PassStep(e))
                axis = r
            else:
                reason = f"chain ends at {prim}"
                break
            v = e.outvars[0]
        return steps[:committed], committed_axis, reason, refusal

    def _plan_site(self, i, eqn, pattern) -> bool:
        first = pattern.inspect_root(eqn)
        chosen = None
        for info in [first] + pattern.alternatives(eqn):   # the first reading that folds
            if isinstance(info, Refusal):
                continue
            if info is not first and self.value(eqn.invars[info.kernel_index]) is None:
                continue     # another reading only for a weight known at transform time: an
                # input on the lhs may as well be the activations
            walked = self._walk(eqn, info, pattern)
            aff = [s for s in walked[0] if isinstance(s, AffineStep)]
            folds = bool(aff) and not (len(aff) == 1 and aff[0].kind in ("add", "sub")) and \
                not self.from_root(eqn.invars[info.kernel_index])
            if chosen is None or folds:
                chosen = (info, walked)
            if folds:
                break
        if chosen is None:
            self._record(eqn, pattern, None, REFUSED, reason=first.reason)
            return False
        info, (steps, end_axis, stop, stop_is_refusal) = chosen
        self.claimed.update(self.producer[s.eqn.outvars[0]][0] for s in steps)
        affine = [s for s in steps if isinstance(s, AffineStep)]
        absorbed = [s.eqn.primitive.name for s in steps]
        backward = bool(affine) and not (len(affine) == 1 and affine[0].kind in ("add", "sub"))
        fwd = self._plan_forward(eqn, pattern, info) if info.kernel_index == 1 else None
        if not backward:
            if not affine:
                if not (fwd is not None and stop == "value is unused"):
                    self._record(eqn, pattern, info, REFUSED if stop_is_refusal else NO_PATTERN,
                                 reason=stop)
            else:
                self._record(eqn, pattern, info, CANONICAL, absorbed=absorbed,
                             reason="already conv + per-channel bias")
            if fwd is None:
                return False
            if not affine:
                steps, end_axis = [], info.channel_axis
            # else: a canonical bias after the root is merged into the forward fold's bias,
            # so the result is conv + one bias and folding again changes nothing

        kernel = eqn.invars[info.kernel_index]
        kernel_names = sorted(n for n in self.names(kernel) if n)
        if self.from_root(kernel):
            reason = ("the kernel (rhs) is computed from a convolution/dot output "
                      "(an activation, e.g. attention), not from parameters")
            if backward:
                self._record(eqn, pattern, info, REFUSED, absorbed=absorbed, reason=reason)
            if fwd is not None:
                self._refuse(fwd.record, reason)
            return False
        rec = None
        if backward:
            op_names = sorted({n for s in affine if s.operand is not None
                               for n in self.names(s.operand.source) if n})
            rec = self._record(eqn, pattern, info, FOLDED, absorbed=absorbed, params=op_names,
                               kernel=", ".join(kernel_names) or None)
            rec.note = f"chain stopped: {stop}" if stop else None
        if fwd is not None:
            fwd.record.kernel = ", ".join(kernel_names) or None
            if not backward and affine:      # the merged canonical bias is read too
                fwd.record.params = sorted(set(fwd.record.params) | {
                    n for s in affine if s.operand is not None
                    for n in self.names(s.operand.source) if n})
        kd = self._kernel_dtype(kernel)
        hint = ("" if self.opts.float32_kernels or kd.itemsize >= 4 else
                "; fold with float32_kernels=True to keep a float32 kernel")
        if backward:
            why = precision_refusal(kd, [eqn.outvars[0].aval.dtype] +
                                    [st.eqn.outvars[0].aval.dtype for st in steps], hint)
            if why:
                if fwd is not None:
                    self._refuse(fwd.record, "the fold after the root is refused")
                return self._refuse(rec, why)
        if fwd is not None:
            why = precision_refusal(kd, [st.eqn.outvars[0].aval.dtype for st in fwd.steps],
                                    hint)
            if why:
                self._refuse(fwd.record, why)
                if not backward:
                    return False
                fwd = None
        end_var = steps[-1].eqn.outvars[0] if steps else eqn.outvars[0]
        site = _Site(i, eqn, info, steps, self.producer[end_var][0], end_var, end_axis, rec,
                     has_shift=any(s.kind in ("add", "sub", "rsub") for s in affine), fwd=fwd)

        # Everything that is known at transform time is computed now, in float64.
        k_val = self.value(kernel)
        k64 = None if k_val is None else _exact_f64(np.asarray(k_val))
        b64 = None
        if fwd is not None:
            vals = [None if s.operand is None else self._operand_value(s.operand)
                    for s in fwd.steps]
            if all(v is not None for s, v in zip(fwd.steps, vals) if s.operand is not None):
                s_in, t_in = _collapse(_kinds(fwd.steps), vals, info.in_channels)
                why = scale_refusal(s_in, "input scale s")
                if why:
                    self._refuse(fwd.record, why)
                    if not backward:
                        return False
                    site.fwd = fwd = None
                else:
                    fwd.s_known, fwd.t_known = s_in, t_in
                    if k64 is not None:
                        s2 = _group_matrix_np(s_in, info.out_channels, fwd.groups)
                        t2 = _group_matrix_np(t_in, info.out_channels, fwd.groups)
                        b64 = np.sum(k64 * _place_np(t2, info.kernel_axis, fwd.k_in_axis,
                                                     k64.ndim),
                                     axis=tuple(a for a in range(k64.ndim)
                                                if a != info.kernel_axis))
                        k64 = k64 * _place_np(s2, info.kernel_axis, fwd.k_in_axis, k64.ndim)
            else:
                k64 = None     # the input scale is computed in the graph
        site.has_shift |= fwd is not None and fwd.has_shift
        op_vals = [None if s.operand is None else self._operand_value(s.operand) for s in affine]
        if all(v is not None for s, v in zip(affine, op_vals) if s.operand is not None):
            s_vec, t_vec = _collapse(_kinds(affine), op_vals, info.out_channels)
            why = scale_refusal(s_vec)
            if why:
                if fwd is not None:
                    self._refuse(fwd.record, "the scale after the root is not finite")
                return self._refuse(rec, why)
            site.s_known, site.t_known = s_vec, t_vec
            if k64 is not None and (fwd is None or fwd.s_known is not None):
                kp_cast, why = round_kernel(k64, _along(s_vec, info.kernel_axis, k64.ndim),
                                            kd, info.kernel_axis)
                if why:
                    if fwd is not None:
                        self._refuse(fwd.record, "the rescaled kernel is refused")
                    return self._refuse(rec, why)
                site.kernel_const = kp_cast
                if b64 is not None:
                    site.t_known = s_vec * b64 + t_vec
        rescale = "constant" if site.kernel_const is not None else "in-graph"
        if rescale == "in-graph" and self.opts.in_graph != "prepared":
            why = (_not_prepared(kernel, site.end_var) if self.opts.in_graph == "never"
                   else runtime_refusal(kd))
            if why:
                if fwd is not None:
                    self._refuse(fwd.record, why)
                return self._refuse(rec, why)
            # the scale is only known at run time: check it there
            site.guard = site.s_known is None or (fwd is not None and fwd.s_known is None)
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.rescale, r.guarded = rescale, site.guard

        if steps:
            self.skip.add(i)
        for s in steps[:-1]:
            self.skip.add(self.producer[s.eqn.outvars[0]][0])
        self.site_at_end[site.end_idx] = site
        return True

    def _kernel_dtype(self, kernel) -> np.dtype:
        """The dtype the folded kernel is rounded to."""
        kd = np.dtype(kernel.aval.dtype)
        if self.opts.float32_kernels and kd.itemsize < 4:
            return np.dtype(np.float32)
        return kd

    def _plan_forward(self, eqn, pattern, info: RootInfo) -> _Forward | None:
        """Follow the root's lhs back through per-input-channel affine ops (single consumer
        each). Returns the forward fold, or None (no chain, or refused: then recorded)."""
        axis = pattern.lhs_channel_axis(eqn)
        if axis is None:
            return None
        producer = lambda u: self.producer.get(u, (0, None))[1]
        v, steps, reason = eqn.invars[0], [], None
        while isinstance(v, C.Var) and v in self.producer:
            k, e = self.producer[v]
            if e.primitive.name not in AFFINE_STEPS or k in self.claimed:
                break
            cands = []
            for pos in range(len(e.invars)):
                if not isinstance(e.invars[pos], C.Var):
                    continue
                r = affine_step(e, pos, axis, producer)
                if isinstance(r, AffineStep) and (r.operand is None
                                                  or not self.from_root(r.operand.source)):
                    cands.append((pos, r))
            if len(cands) != 1:
                if len(cands) > 1:
                    reason = "both operands of the op before the root look per-channel"
                break
            n = len(self.uses.get(v, [])) + self.out_uses.get(v, 0)
            if n != 1:
                reason = f"the root's input (or a value before it) has {n} consumers"
                break
            steps.append(cands[0][1])
            v = e.invars[cands[0][0]]
        fpat = FORWARD[eqn.primitive.name]
        self.forward_taken.update(self.producer[s.eqn.outvars[0]][0] for s in steps)
        if not steps:
            if reason is not None:     # an affine op was there, but could not be taken
                self._record(eqn, fpat, info, REFUSED, reason=reason)
            return None
        steps.reverse()
        names = sorted({n for s in steps if s.operand is not None
                        for n in self.names(s.operand.source) if n})
        ic = pattern.input_channel(eqn)
        absorbed = [s.eqn.primitive.name for s in steps]
        if isinstance(ic, Refusal):
            self._record(eqn, fpat, info, REFUSED, absorbed=absorbed, params=names,
                         reason=ic.reason)
            return None
        rec = self._record(eqn, fpat, info, FOLDED, absorbed=absorbed, params=names)
        rec.note = f"chain stopped: {reason}" if reason else None
        return _Forward(steps, v, ic[1], info.groups, rec)

    def _refuse(self, rec: FoldSite | None, reason: str) -> bool:
        if rec is not None:
            rec.status, rec.reason, rec.rescale, rec.guarded = REFUSED, reason, None, False
        return False

    def _operand_value(self, op: ChannelOperand):
        val = self.value(op.source)
        if val is None:
            return None
        arr = np.asarray(val)
        for dt in op.casts:
            arr = arr.astype(np.dtype(dt))
        return arr.reshape(-1) if op.source_axis is not None else arr.reshape(())

    # ---- nested jaxprs

    def _child(self, sub: C.ClosedJaxpr, outer: Sequence[Any], known_mask: Sequence[bool],
               label: str) -> C.ClosedJaxpr:
        known_in, names_in = [], []
        for atom, k in zip(outer, known_mask):
            known_in.append((lambda a=atom: self.value(a)) if k else _NONE)
            names_in.append(lambda a=atom: self.names(a))
        child = _Scope(sub, known_in, names_in, [None] * len(sub.consts),
                       f"{self.path}/{label}", self.sites, self.opts)
        return child.fold()

    def _plan_nested(self, i, eqn) -> bool:
        prim, params = eqn.primitive.name, eqn.params
        label = f"{prim}({params['name']})" if isinstance(params.get("name"), str) else prim
        if prim in _CALL_NAMES:
            key, sub = C.call_body(eqn)
            if sub is None:
                return False
            new = self._child(sub, eqn.invars, [True] * len(eqn.invars), label)
            if new is sub:
                return False
            self.new_eqn[i] = ({**params, key: new}, 0, [])
            return True
        if prim in _REMAT_NAMES:
            sub = C.ClosedJaxpr(C.remat_body(eqn), ())
            new = self._child(sub, eqn.invars, [True] * len(eqn.invars), label)
            if new is sub:
                return False
            open_j, consts = C.hoist_consts(new)
            self.new_eqn[i] = (C.with_remat_body(params, open_j), 0, consts)
            return True
        if prim == "cond":
            ops = eqn.invars[1:]
            branches = C.cond_branches(eqn)
            news = [self._child(b, ops, [True] * len(ops), f"cond[{k}]")
                    for k, b in enumerate(branches)]
            if all(n is b for n, b in zip(news, branches)):
                return False
            all_consts = [c for n in news for c in n.consts]
            offs = np.cumsum([0] + [len(n.consts) for n in news]).tolist()
            in_avals = [C.shape_struct(v.aval) for v in ops]
            const_avals = [jax.ShapeDtypeStruct(np.shape(c), _dtype_of(c)) for c in all_consts]
            new_branches = tuple(
                _with_leading_consts(n, offs[k], offs[k + 1], const_avals, in_avals)
                for k, n in enumerate(news))
            self.new_eqn[i] = (C.with_cond_branches(params, new_branches), 1, all_consts)
            return True
        if prim == "scan":
            sub, nc = C.scan_body(eqn)
            new = self._child(sub, eqn.invars, [k < nc for k in range(len(eqn.invars))], label)
            if new is sub:
                return False
            consts = list(new.consts)
            body = _with_leading_consts(new, 0, len(consts),
                                        [jax.ShapeDtypeStruct(np.shape(c), _dtype_of(c))
                                         for c in consts],
                                        [C.shape_struct(v.aval) for v in sub.jaxpr.invars])
            self.new_eqn[i] = (C.with_scan_body(params, body, len(consts)), 0, consts)
            return True
        if prim == "while":
            sub, cn, bn = C.while_body(eqn)
            body_outer = eqn.invars[cn:]
            new = self._child(sub, body_outer, [k < bn for k in range(len(body_outer))], label)
            if new is sub:
                return False
            consts = list(new.consts)
            body = _with_leading_consts(new, 0, len(consts),
                                        [jax.ShapeDtypeStruct(np.shape(c), _dtype_of(c))
                                         for c in consts],
                                        [C.shape_struct(v.aval) for v in sub.jaxpr.invars])
            self.new_eqn[i] = (C.with_while_body(params, body, len(consts)), cn, consts)
            return True
        # Any other primitive carrying closed jaxprs: fold inside with nothing known.
        new_params, changed = dict(params), False
        for key, val in params.items():
            if isinstance(val, C.ClosedJaxpr):
                new = self._child(val, [None] * len(val.jaxpr.invars),
                                  [False] * len(val.jaxpr.invars), f"{label}.{key}")
                if new is not val:
                    new_params[key], changed = new, True
        if changed:
            self.new_eqn[i] = (new_params, 0, [])
        return changed

    # ---- emission

    def _emit(self) -> C.ClosedJaxpr:
        """Splice the plan into the program: untouched equations are kept as they are (no
        retrace), each folded site is traced on its own and inlined where its chain ended,
        and rebuilt higher-order equations get their hoisted constants as new constvars."""
        jaxpr = self.jaxpr
        constvars, consts = list(jaxpr.constvars), list(self.closed.consts)

        def new_const(value) -> Any:
            v = C.new_var(C.aval_of(value))
            constvars.append(v)
            consts.append(value)
            return v

        site_eqns = self._all_site_eqns(new_const)
        eqns = []
        for i, eqn in enumerate(jaxpr.eqns):
            if i in self.skip:
                continue
            if i in site_eqns:
                eqns.extend(site_eqns[i])
            elif i in self.new_eqn:
                params, at, extra = self.new_eqn[i]
                ins = list(eqn.invars)
                ins[at:at] = [new_const(c) for c in extra]
                eqns.append(eqn.replace(params=params, invars=ins))
            else:
                eqns.append(eqn)
        return C.ClosedJaxpr(jaxpr.replace(constvars=constvars, eqns=eqns), consts)

    def _all_site_eqns(self, new_const) -> dict[int, list]:
        """The equations of every folded site of this scope, keyed by where each goes.

        All sites are traced together (one trace is much cheaper than one per site), then
        the traced equations are split by the site whose result they feed."""
        sites = [self.site_at_end[i] for i in sorted(self.site_at_end)]
        if not sites:
            return {}
        # Sites of the same structure and shapes whose rescale is entirely in the graph trace
        # to the same equations up to renaming: trace one per group, clone it for the rest.
        groups: dict[Any, list] = {}
        traced = []
        for site in sites:
            key = self._template_key(site) if CLONE_TEMPLATES else None
            if key is None or key not in groups:
                traced.append(site)
            if key is not None:
                groups.setdefault(key, []).append(site)
        out = self._traced_site_eqns(traced, new_const)
        for members in groups.values():
            first = members[0]
            atoms = self._site_atoms(first)
            for site in members[1:]:
                out[site.end_idx] = _clone_eqns(out[first.end_idx], atoms,
                                                self._site_atoms(site), first.end_var,
                                                site.end_var, first.eqn, site.eqn)
        return out

    def _site_atoms(self, site) -> list:
        """The scope variables a folded site's equations read (kernel, input, operands; for
        a guarded site also every operand of its original equations)."""
        internal = {site.eqn.outvars[0]} | {st.eqn.outvars[0] for st in site.steps}
        return list(dict.fromkeys(
            [v for v in site.eqn.invars if isinstance(v, C.Var)] +
            [st.operand.source for st in site.steps + (site.fwd.steps if site.fwd else [])
             if isinstance(st, AffineStep) and st.operand is not None
             and isinstance(st.operand.source, C.Var)] +
            ([site.fwd.source] if site.fwd and isinstance(site.fwd.source, C.Var) else []) +
            ([v for st in site.steps for v in st.eqn.invars
              if isinstance(v, C.Var) and v not in internal] if site.guard else [])))

    def _template_key(self, site):
        """A hashable description of a site's plan, derived from its equations and plan
        fields themselves (every field, so a new one cannot be forgotten): two sites with
        equal keys trace to the same equations up to renaming. None when the site bakes a
        value known at transform time into its equations (it is traced on its own)."""
        atoms = self._site_atoms(site)
        index = {a: k for k, a in enumerate(atoms)}
        internal: dict[Any, int] = {}

        def atom(v):
            if isinstance(v, C.Literal):
                return ("literal", repr(v.val), v.aval.dtype)
            if v in index:
                return ("input", index[v])
            # an internal value's type follows from the inputs' types and the equations
            return ("internal", internal.setdefault(v, len(internal)))

        def plan(x):
            if isinstance(x, C.JaxprEqn):
                return (x.primitive.name, tuple(sorted(x.params.items())),
                        tuple(map(atom, x.invars)), tuple(map(atom, x.outvars)))
            if isinstance(x, (C.Var, C.Literal)):
                return atom(x)
            if isinstance(x, np.ndarray):
                raise TypeError("a value known at transform time")
            if isinstance(x, (list, tuple)):
                return tuple(map(plan, x))
            if dataclasses.is_dataclass(x) and not isinstance(x, type):
                return (type(x).__name__,) + tuple(
                    plan(getattr(x, f.name)) for f in dataclasses.fields(x)
                    if f.name not in _NOT_PLAN)
            return x

        try:
            key = (plan(site), tuple((a.aval.shape, str(a.aval.dtype),
                                      getattr(a.aval, "weak_type", False)) for a in atoms),
                   self.opts)
            hash(key)
        except TypeError:
            return None
        if any(self._operand_value(st.operand) is not None
               for st in site.steps + (site.fwd.steps if site.fwd else [])
               if isinstance(st, AffineStep) and st.operand is not None):
            return None
        return key

    def _traced_site_eqns(self, sites, new_const) -> dict[int, list]:
        """Trace ``sites`` together and split the equations per site."""
        atoms = list(dict.fromkeys(v for site in sites for v in self._site_atoms(site)))
        index = {a: k for k, a in enumerate(atoms)}

        def fn(*vals):
            def read(a):
                return a.val if isinstance(a, C.Literal) else vals[index[a]]
            return [self._emit_site(site, read) for site in sites]

        sub = C.trace(fn, [a.aval for a in atoms])
        ren: dict[Any, Any] = dict(zip(sub.jaxpr.invars, atoms))
        ren.update((cv, new_const(c)) for cv, c in zip(sub.jaxpr.constvars, sub.consts))
        owner: dict[Any, int] = {}
        final: dict[Any, Any] = {}
        for k, (site, out) in enumerate(zip(sites, sub.jaxpr.outvars)):
            owner[out] = k
            final[out] = site.end_var
        by_site: list[list] = [[] for _ in sites]
        for e in reversed(sub.jaxpr.eqns):
            k = next((owner[o] for o in e.outvars if o in owner), None)
            if k is None:       # feeds no site result (cannot happen: nothing is dead here)
                continue
            for v in e.invars:
                if isinstance(v, C.Var):
                    owner.setdefault(v, k)
            by_site[k].append(e.replace(
                invars=[ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars],
                outvars=[final.get(o, o) for o in e.outvars]))
        return {site.end_idx: list(reversed(eqs)) for site, eqs in zip(sites, by_site)}

    def _emit_site(self, site: _Site, read):
        eqn, info, fwd = site.eqn, site.info, site.fwd
        kernel = eqn.invars[info.kernel_index]
        affine = [s for s in site.steps if isinstance(s, AffineStep)]
        end_dtype = np.dtype(site.end_var.aval.dtype)
        t = site.t_known
        with C.source_of(eqn):
            if site.kernel_const is not None:
                kp = site.kernel_const
            else:
                k = read(kernel)
                kd = np.dtype(kernel.aval.dtype)
                cdt = np.float64 if max(kd.itemsize, end_dtype.itemsize) > 4 and \
                    jax.config.jax_enable_x64 else np.float32
                xp = _jnp(cdt)
                kc = _cast(k, cdt)
                b = None
                if fwd is not None:
                    if fwd.s_known is not None:
                        s_in, t_in = fwd.s_known, fwd.t_known
                    else:
                        vals = [None if st.operand is None else
                                self._operand_traced(st.operand, read, cdt)
                                for st in fwd.steps]
                        s_in, t_in = _collapse(_kinds(fwd.steps), vals, info.in_channels,
                                               xp=xp)
                    nd, ko, ki = len(kernel.aval.shape), info.kernel_axis, fwd.k_in_axis
                    if fwd.has_shift:
                        t2 = _group_matrix_traced(xp.asarray(t_in), info.out_channels,
                                                  fwd.groups)
                        b = _reduce_but(xp.mul(kc, _place_traced(t2, ko, ki, nd)), ko)
                    s2 = _group_matrix_traced(xp.asarray(s_in), info.out_channels, fwd.groups)
                    kc = xp.mul(kc, _place_traced(s2, ko, ki, nd))
                if site.s_known is not None:
                    s, t = site.s_known, site.t_known
                else:
                    vals = [None if st.operand is None else
                            self._operand_traced(st.operand, read, cdt) for st in affine]
                    s, t = _collapse(_kinds(affine), vals, info.out_channels, xp=xp)
                s = xp.asarray(s)
                if b is not None:
                    t = xp.add(xp.mul(s, b), xp.asarray(t))
                kp = xp.mul(kc, _along_traced(s, info.kernel_axis, len(kernel.aval.shape)))
                kp = _cast(kp, self._kernel_dtype(kernel))
            if site.guard:
                # run-time check of what transform time could not see (σ² = 0, inf γ,
                # overflow): a non-finite kernel or bias runs the site's original equations
                ok = _all_finite(kp)
                if site.has_shift and not isinstance(t, np.ndarray):
                    ok = lax.bitwise_and(ok, _all_finite(_cast(t, end_dtype)))
                with jax.named_scope(GUARD_SCOPE):
                    return lax.cond(ok, lambda: self._folded_value(site, read, kp, t),
                                    lambda: self._original_value(site, read))
            return self._folded_value(site, read, kp, t)

    def _original_value(self, site: _Site, read):
        """The site's original equations, replayed (the guard's fallback)."""
        y = C.bind_eqn(site.eqn, [read(v) for v in site.eqn.invars])[0]
        prev = site.eqn.outvars[0]
        for st in site.steps:
            y = C.bind_eqn(st.eqn, [y if v is prev else read(v) for v in st.eqn.invars])[0]
            prev = st.eqn.outvars[0]
        return y

    def _folded_value(self, site: _Site, read, kp, t):
        """``root(x, kp)``, the chain's shape ops replayed, plus the bias ``t``."""
        eqn, info, fwd = site.eqn, site.info, site.fwd
        kernel = eqn.invars[info.kernel_index]
        end_dtype = np.dtype(site.end_var.aval.dtype)
        with C.source_of(eqn):
            invals = [read(v) for v in eqn.invars]
            invals[info.kernel_index] = kp
            if fwd is not None:
                invals[0] = read(fwd.source)
            out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
            if np.dtype(kp.dtype) != np.dtype(kernel.aval.dtype):   # float32_kernels
                invals[0] = _cast(invals[0], kp.dtype)
                params = dict(eqn.params)
                if params.get("preferred_element_type") is not None:
                    params["preferred_element_type"] = np.dtype(np.float32)
                y = _cast(C.bind_eqn(eqn, invals, params)[0], out_dtype)
            else:
                y = C.bind_eqn(eqn, invals)[0]
            for st in site.steps:
                if isinstance(st, PassStep):
                    y = C.bind_eqn(st.eqn, [y])[0]
            if site.has_shift:
                shape = [1] * len(site.end_var.aval.shape)
                if isinstance(t, np.ndarray):
                    tb = np.asarray(t, np.float64).astype(end_dtype)
                    if tb.ndim:
                        shape[site.end_axis] = tb.shape[0]
                    tb = tb.reshape(shape)
                else:
                    tb = _cast(t, end_dtype)
                    dims = (site.end_axis,) if tb.ndim else ()
                    if tb.ndim:
                        shape[site.end_axis] = tb.shape[0]
                    tb = lax.broadcast_in_dim(tb, tuple(shape), dims)
                y = lax.add(y, tb)
        return y

    def _operand_traced(self, op: ChannelOperand, read, cdt):
        known = self._operand_value(op)
        if known is not None:
            return known.astype(np.float64)
        val = read(op.source)
        for dt in op.casts:
            val = _cast(val, dt)
        shape = (op.size,) if op.source_axis is not None else ()
        if tuple(val.shape) != shape:
            val = lax.reshape(val, shape)
        return _cast(val, cdt)


# --------------------------------------------------------------------------- helpers


class _np64:
    """Arithmetic on the host in float64 (all operands known at transform time)."""

    @staticmethod
    def asarray(x):
        return np.asarray(x, np.float64)

    add, sub, mul, div = (np.add, np.subtract, np.multiply, np.divide)
    neg = staticmethod(np.negative)


def _jnp(cdt):
    """Arithmetic staged with ``lax`` in ``cdt`` (no ``jnp`` dispatch: folding stays cheap);
    operands that are known stay NumPy constants."""

    def lift(x):
        if isinstance(x, np.ndarray) or np.isscalar(x):
            return np.asarray(x, np.float64).astype(cdt)
        return x

    def binary(np_op, lax_op):
        def op(a, b):
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
                return np_op(a, b).astype(cdt)
            a, b = lift(a), lift(b)     # a NumPy operand takes the arithmetic dtype
            # scalars are broadcast explicitly; equal ranks rely on lax's size-1 broadcasting
            shape = np.broadcast_shapes(np.shape(a), np.shape(b))
            a, b = (x if np.ndim(x) or not shape else
                    (np.broadcast_to(x, shape) if isinstance(x, np.ndarray)
                     else lax.broadcast_in_dim(x, shape, ())) for x in (a, b))
            return lax_op(a, b)
        return staticmethod(op)

    class _ns:
        asarray = staticmethod(lift)
        add = binary(np.add, lax.add)
        sub = binary(np.subtract, lax.sub)
        mul = binary(np.multiply, lax.mul)
        div = binary(np.divide, lax.div)

        @staticmethod
        def neg(x):
            return np.negative(x) if isinstance(x, np.ndarray) else lax.neg(x)
    return _ns


def _kinds(steps) -> list[str]:
    return [st.kind for st in steps]


def _collapse(kinds: Sequence[str], vals: list, channels: int, xp=_np64):
    """Collapse absorbed ops (``kinds``: add/sub/rsub/mul/div/neg, with operand ``vals``)
    into (s, t): vectors of length ``channels`` or scalars. ``xp`` is the arithmetic: NumPy
    float64 on the host, ``lax`` in a trace, or StableHLO ops (``hlofold._stablehlo``).

    ``None`` stands for the identity (s = 1, t = 0) so no arithmetic is emitted for it.
    """
    s: Any = None
    t: Any = None
    for kind, c in zip(kinds, vals):
        if c is not None:
            c = xp.asarray(c)
        if kind == "add":
            t = c if t is None else xp.add(t, c)
        elif kind == "sub":
            t = xp.neg(c) if t is None else xp.sub(t, c)
        elif kind == "rsub":
            s = xp.asarray(-1.0) if s is None else xp.neg(s)
            t = c if t is None else xp.sub(c, t)
        elif kind == "mul":
            s = c if s is None else xp.mul(s, c)
            t = None if t is None else xp.mul(t, c)
        elif kind == "div":
            s = xp.div(xp.asarray(1.0), c) if s is None else xp.div(s, c)
            t = None if t is None else xp.div(t, c)
        elif kind == "neg":
            s = xp.asarray(-1.0) if s is None else xp.neg(s)
            t = None if t is None else xp.neg(t)
    s = xp.asarray(1.0) if s is None else s
    t = xp.asarray(0.0) if t is None else t
    if xp is _np64:
        s = np.broadcast_to(s, (channels,)) if np.ndim(s) else s
        t = np.broadcast_to(t, (channels,)) if np.ndim(t) else t
        return np.asarray(s, np.float64), np.asarray(t, np.float64)
    return s, t


def is_guard(eqn) -> bool:
    """Whether ``eqn`` is the run-time guard of a folded site."""
    return eqn.primitive.name == "cond" and GUARD_SCOPE in C.name_stack(eqn)


def _all_finite(x):
    f = lax.is_finite(x)
    return lax.reduce_and(f, tuple(range(f.ndim))) if f.ndim else f


def _dce(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """Drop the equations of this scope whose results nobody reads (the per-channel
    operand plumbing a fold leaves behind). Effectful equations stay; nested jaxprs are not
    entered (they were already folded and cleaned when they changed)."""
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if isinstance(v, C.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(o in live for o in eqn.outvars if not isinstance(o, C.DropVar)):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, C.Var))
    kept.reverse()
    used = [v in live for v in jaxpr.constvars]
    new = jaxpr.replace(constvars=[v for v, u in zip(jaxpr.constvars, used) if u], eqns=kept)
    return C.ClosedJaxpr(new, [c for c, u in zip(closed.consts, used) if u])


def _clone_eqns(eqns: list, from_atoms: list, to_atoms: list, from_end, to_end,
                from_root, to_root) -> list:
    """``eqns`` (one site's equations, reading ``from_atoms``, ending in ``from_end``) renamed
    for another site: inputs mapped to ``to_atoms``, fresh variables inside, ``to_end`` out,
    and the source location and name scope of ``from_root`` replaced by ``to_root``'s."""
    ren: dict[Any, Any] = dict(zip(from_atoms, to_atoms))
    ren[from_end] = to_end
    out = []
    for e in eqns:
        ins = [ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars]
        outs = []
        for o in e.outvars:
            if o not in ren:
                ren[o] = C.new_var(o.aval)
            outs.append(ren[o])
        out.append(e.replace(invars=ins, outvars=outs,
                             source_info=C.rebase_source(e, from_root, to_root)))
    return out


def _group_matrix_np(vec, out_channels: int, groups: int):
    """Per-input-channel ``vec`` (length C_in, or a scalar) as the (O, C_in/G) matrix of the
    kernel entries it multiplies: output channel o reads the inputs of group o // (O/G)."""
    vec = np.asarray(vec, np.float64)
    if vec.ndim == 0:
        return vec
    return np.repeat(vec.reshape(groups, -1), out_channels // groups, axis=0)


def _group_matrix_traced(vec, out_channels: int, groups: int):
    if isinstance(vec, np.ndarray):
        return _group_matrix_np(vec, out_channels, groups)
    if vec.ndim == 0:
        return vec
    ipg = vec.shape[0] // groups
    m = lax.broadcast_in_dim(lax.reshape(vec, (groups, ipg)),
                             (groups, out_channels // groups, ipg), (0, 2))
    return lax.reshape(m, (out_channels, ipg))


def _place_np(m, o_axis: int, i_axis: int, ndim: int):
    """The (O, I) matrix ``m`` shaped to multiply a kernel with those axes."""
    if np.ndim(m) == 0:
        return m
    if o_axis > i_axis:
        m = m.T
    shape = [1] * ndim
    shape[o_axis], shape[i_axis] = (m.shape[0], m.shape[1]) if o_axis < i_axis else \
        (m.shape[1], m.shape[0])
    return m.reshape(shape)


def _place_traced(m, o_axis: int, i_axis: int, ndim: int):
    if isinstance(m, np.ndarray) or np.ndim(m) == 0:
        return _place_np(m, o_axis, i_axis, ndim) if isinstance(m, np.ndarray) else m
    if o_axis > i_axis:
        m = lax.transpose(m, (1, 0))
    shape = [1] * ndim
    lo, hi = sorted((o_axis, i_axis))
    shape[lo], shape[hi] = m.shape[0], m.shape[1]
    return lax.reshape(m, tuple(shape))


def _reduce_but(x, axis: int):
    """Sum ``x`` over every axis but ``axis``."""
    axes = tuple(a for a in range(x.ndim) if a != axis)
    if isinstance(x, np.ndarray):
        return np.sum(x, axis=axes)
    return lax.reduce_sum(x, axes)


def _cast(x, dtype):
    """``convert_element_type`` only when the dtype changes (no equation otherwise)."""
    if np.dtype(x.dtype) == np.dtype(dtype) and not getattr(x, "weak_type", False):
        return x
    return lax.convert_element_type(x, dtype)


def _along(vec, axis: int, ndim: int) -> np.ndarray:
    vec = np.asarray(vec)
    if vec.ndim == 0:
        return vec
    shape = [1] * ndim
    shape[axis] = vec.shape[0]
    return vec.reshape(shape)


def _along_traced(vec, axis: int, ndim: int):
    if isinstance(vec, np.ndarray):
        return _along(vec, axis, ndim)
    if vec.ndim == 0:
        return vec
    shape = [1] * ndim
    shape[axis] = vec.shape[0]
    return lax.broadcast_in_dim(vec, tuple(shape), (axis,))


def _exact_f64(k: np.ndarray) -> np.ndarray:
    """``k`` for float64 arithmetic: float32/float64 as they are (NumPy promotes them exactly
    in a product with float64 — no separate conversion pass), other dtypes converted."""
    return k if k.dtype in (np.float32, np.float64) else k.astype(np.float64)


def _desc(v) -> str:
    return f"value {v.aval.str_short()}"


def _dtype_of(c):
    return getattr(c, "dtype", np.asarray(c).dtype)


def _evaluable(eqn) -> bool:
    if eqn.effects:
        return False
    for o in eqn.outvars:
        if int(np.prod(getattr(o.aval, "shape", ()), dtype=np.int64)) > _MAX_CONST_EVAL:
            return False
    return True


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, C.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, C.Jaxpr):
                yield x


def _contains_root(eqn) -> bool:
    """Whether a nested jaxpr of ``eqn`` holds a pattern root (searched once per jaxpr)."""
    for j in _subjaxprs(eqn):
        key = id(j)
        if key not in _ROOT_CACHE:
            if len(_ROOT_CACHE) > 4096:
                _ROOT_CACHE.clear()
            _ROOT_CACHE[key] = (j, any(e.primitive.name in PATTERNS or _contains_root(e)
                                       for e in j.eqns))
        if _ROOT_CACHE[key][1]:
            return True
    return False


_ROOT_CACHE: dict[int, tuple[Any, bool]] = {}


def _with_leading_consts(closed: C.ClosedJaxpr, lo: int, hi: int, const_avals, in_avals):
    """Rebuild ``closed`` (whose consts are ``all_consts[lo:hi]``) as a const-free closed
    jaxpr taking ``(*all_consts, *inputs)``."""
    n = len(const_avals)

    def fn(*a):
        return C.eval_jaxpr(closed.jaxpr, a[lo:hi], *a[n:])

    return jax.make_jaxpr(fn)(*const_avals, *in_avals)
