"""The jaxpr folder: ``fold_jaxpr`` and the scope that walks one (closed) jaxpr.

For every root equation a pattern is registered for (``conv_general_dilated``,
``dot_general``), the scope follows the root's output through a chain of per-output-channel
affine operations, collapsing them into a running ``y·s + t`` (``_base.algebra``):

    add c: t += c    sub c: t -= c    c - y: s, t = -s, c - t    neg: s, t = -s, -t
    mul c: s, t = s·c, t·c      div c: s, t = s/c, t/c

and rewrites the chain to ``conv(x, K ⊙ s) + broadcast_in_dim(t)``. ``K ⊙ s`` scales the
kernel along its output-feature dimension, which is exact for any rank, stride, padding,
dilation (lhs dilation included) and feature/batch grouping.

The work is split by job: this module holds the scope (the walk over equations, the report
records, nested jaxprs through the rule table of ``_fold.jaxpr.nested``); ``_fold.jaxpr.values`` its
known values and provenance; ``_fold.jaxpr.plan`` decides each site (matching with ``_fold.core.patterns``
and ``_base.chain_rules``, the shared decision of ``_fold.core.decide``); ``_fold.jaxpr.emit`` splices the
folded equations into the program. The plan is made outside any trace, with constants
evaluated eagerly (``K ⊙ s`` of constant parameters computed once, in float64 on the host);
emission keeps every untouched equation and traces only the folded sites' parameter side.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from hlofold import _compat as C
from .check import checked
from .emit import SiteEmitter, is_guard
from .merge import merge_scope
from .canonical import products
from .nested import NESTED_RULES, contains_root, inline_calls, inline_crossed, other_rule
from hlofold._fold.core.decide import IN_GRAPH_POLICIES
from .plan import Site, SitePlanner
from .values import NONE, ScopeValues
from .steps import AFFINE_STEPS, PASS_STEPS, resolve_operand
from hlofold._base.chain_rules import Refusal
from .patterns import PATTERNS, RootInfo
from hlofold._base.report import FOLDED, MERGED, NOT_REACHED, REFUSED, FoldReport, FoldSite
from hlofold._base.reasons import Reason
from hlofold._fold.core.unreached import unreached_reason

_MAX_INLINE_ROUNDS = 8      # calls within calls a chain is followed into


def fold_jaxpr(closed: C.ClosedJaxpr, *, invar_names: Sequence[str] | None = None,
               const_names: Sequence[str] | None = None,
               float32_kernels: bool = False, in_graph: str = "guarded",
               cost: Sequence[str] | None = None,
               merge: bool = True) -> tuple[C.ClosedJaxpr, FoldReport]:
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

      cost: apply :func:`hlofold.fold`'s cost rule (``hlofold._fold.core.cost``) to sites whose
        parameters are inputs or the constants named here (values prepared from inputs,
        whose folded copies would be held beside them): a site whose fold removes no pass
        over a tensor is left (status ``left``, with its figures). None (default): fold
        every safe site.

      merge: merge sums of parallel branches into one convolution (``_fold.jaxpr.merge``).

    Returns ``(folded, report)``. ``folded`` has the same inputs and outputs as ``closed``;
    when nothing folds it *is* ``closed``.
    """
    if in_graph not in IN_GRAPH_MODES:
        raise ValueError(f"in_graph must be one of {IN_GRAPH_MODES}, got {in_graph!r}")
    off = C.disabled("jaxpr")
    if off is not None:         # this JAX changed what the jaxpr path reads: fold nothing
        return closed, unchanged_report(off)
    try:
        closed = C.as_closed(closed)
    except TypeError:
        raise TypeError(f"fold_jaxpr expects a ClosedJaxpr (from jax.make_jaxpr), got "
                        f"{type(closed).__name__}") from None
    n_in = len(closed.jaxpr.invars)
    names = list(invar_names) if invar_names is not None else [f"arg{i}" for i in range(n_in)]
    if len(names) != n_in:
        raise ValueError(f"invar_names has {len(names)} entries for {n_in} inputs")
    cnames = list(const_names) if const_names is not None else [None] * len(closed.consts)
    sites: list[FoldSite] = []
    opts = _Options(float32_kernels=float32_kernels, in_graph=in_graph,
                    cost=None if cost is None else frozenset(cost), merge=merge)
    scope = _Scope(closed,
                   known_in=[NONE] * n_in,
                   names_in=[_const(frozenset({n})) for n in names],
                   const_names=cnames, path="top", sites=sites, opts=opts)
    try:
        folded = scope.fold()
    except Exception as e:      # an internal this JAX changed, met mid-fold: fold nothing
        err = C.as_compat(e)    # (on a tested JAX, only a CompatError; others are bugs)
        if err is None:
            raise
        return closed, unchanged_report(err)
    return checked(closed, folded, FoldReport(sites, compat=list(opts.compat)))


def unchanged_report(err: Exception) -> FoldReport:
    """The report of a program left as it was because this JAX changed what hlofold reads."""
    return FoldReport([], running=f"the original program ({err})", compat=[str(err)])


def plan_sites(closed: C.ClosedJaxpr, known: Sequence[Any], names: Sequence[str],
               in_graph: str = "never"):
    """Plan the top scope of ``closed`` without rewriting it, its inputs bound to ``known``
    (None: not known; with ``in_graph="prepared"`` a site whose kernel is not known still
    folds, its scale known). Returns the scope: ``sites`` (report records), ``site_at_end``
    (the folded sites' plans), ``producer``, ``uses``, ``value``, and ``stacks``: each
    scanned stack folded per layer, ``(scan equation, layer scopes)``."""
    sites: list[FoldSite] = []
    scope = _Scope(closed, known_in=[_const(k) for k in known],
                   names_in=[_const(frozenset({n})) for n in names],
                   const_names=[None] * len(closed.consts), path="top", sites=sites,
                   opts=_Options(in_graph=in_graph, keep_stacks=True))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scope.plan()
    return scope


# the in-graph policies of ``_fold.core.decide`` a caller of fold_jaxpr picks ("unguarded": the
# caller checks the folded values for finiteness itself, as hlofold.fold's device prepare)
IN_GRAPH_MODES = IN_GRAPH_POLICIES
@dataclasses.dataclass(frozen=True)
class _Options:
    float32_kernels: bool = False
    in_graph: str = "guarded"
    cost: frozenset | None = None     # hlofold.fold's cost rule (names of prepared constants)
    merge: bool = True                # parallel branches merged (_fold.jaxpr.merge)
    keep_stacks: bool = False         # keep each folded stack's per-layer scopes (fold_params)
    # what this JAX changed that kept the fold out of part of the program (filled on the way)
    compat: list = dataclasses.field(default_factory=list, compare=False, hash=False)


def _const(v):
    return lambda: v


class _Scope(ScopeValues, SitePlanner, SiteEmitter):
    """Planning and emission for one (closed) jaxpr."""

    def __init__(self, closed: C.ClosedJaxpr, known_in: list[Callable], names_in: list[Callable],
                 const_names: list, path: str, sites: list[FoldSite], opts: "_Options",
                 sources_in: list[Callable] | None = None):
        self.opts = opts
        self.original = closed           # returned when nothing folds
        self.path = path
        self.sites = sites
        self.known_thunks: dict[Any, Callable] = dict(zip(closed.jaxpr.invars, known_in))
        self.name_thunks: dict[Any, Callable] = dict(zip(closed.jaxpr.invars, names_in))
        # a nested scope's inputs are made of the outer scope's sources; the top scope's
        # inputs are sources of their own (bit i for input i)
        self.source_thunks: dict[Any, Callable] = dict(zip(
            closed.jaxpr.invars, sources_in or [(lambda i=i: 1 << i)
                                                for i in range(len(closed.jaxpr.invars))]))
        self.const_names = list(const_names)
        self._index(closed, const_names)

    def _index(self, closed: C.ClosedJaxpr, const_names: Sequence) -> None:
        """(Re)build what planning reads of ``closed`` and clear the plan: ``closed`` is the
        scope's program, or it with calls inlined (same inputs and outputs)."""
        self.closed = closed
        self.jaxpr = closed.jaxpr
        self.known: dict[Any, Any] = {}
        self.flushed: set = set()     # values whose host value a flushing backend would not get
        self.origins: dict[Any, frozenset] = {}
        self.source_bits: dict[Any, int] = {}
        self.activation: dict[Any, bool] = {}
        self.maybe_known: dict[Any, bool] = {}
        self.swept: dict[int, int] = {}      # per memo: the equations swept so far
        names = list(const_names) + [None] * (len(closed.consts) - len(const_names))
        for v, val, nm in zip(self.jaxpr.constvars, closed.consts, names):
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
        for v in (v for v in self.jaxpr.outvars if isinstance(v, C.Var)):
            self.out_uses[v] = self.out_uses.get(v, 0) + 1
        self.site_at_end: dict[int, Site] = {}
        self.skip: set[int] = set()
        # equations on the backward chain of an earlier root (folded or canonical): a later
        # root's forward chain must not take them (one op, one owner)
        self.claimed: set[int] = set()
        self.forward_taken: set[int] = set()     # equations of forward chains (any status)
        self.new_eqn: dict[int, tuple[dict, Callable]] = {}
        # calls (jit/pjit) a chain continues into: inlined, then the scope is planned again
        self.calls_reached: set[int] = set()
        # scanned stacks folded per layer, with opts.keep_stacks: (scan eqn, layer scopes)
        self.stacks: list[tuple[Any, list]] = []

    def fold(self) -> C.ClosedJaxpr:
        first = len(self.sites)
        changed = self.plan()
        try:
            return self._merged(_dce(self._emit()) if changed else self.original)
        except Exception as e:     # fail closed: this scope runs as written, and says why
            for rec in self.sites[first:]:
                if rec.status in (FOLDED, MERGED):
                    rec.status = REFUSED
                    rec.reason = Reason("internal", f"hlofold could not rewrite this part of "
                                        f"the program ({type(e).__name__}: {e}); it runs "
                                        "unfolded — please report this")
            warnings.warn(f"hlofold: a scope of the program is left unfolded after an "
                          f"internal error ({type(e).__name__}: {e})", RuntimeWarning,
                          stacklevel=2)
            return self.original

    def _merged(self, closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
        """``closed`` (this scope, folded) with its sums of parallel branches merged
        (``_fold.jaxpr.merge``), planned over a scope of its own."""
        prims = {e.primitive.name for e in closed.jaxpr.eqns}
        if not self.opts.merge or "add" not in prims or not prims & {"conv_general_dilated", "cond"}:
            return closed
        named = dict(zip(self.jaxpr.constvars, self.const_names))
        ins = closed.jaxpr.invars
        view = _Scope(closed, [self.known_thunks.get(v, NONE) for v in ins],
                      [self.name_thunks.get(v, _const(frozenset())) for v in ins],
                      [named.get(v) for v in closed.jaxpr.constvars], self.path, self.sites,
                      self.opts, [self.source_thunks.get(v, _const(0)) for v in ins])
        new = merge_scope(view, self.opts.in_graph, self.path, self.sites,  # fold_params:
                          write=not self.opts.keep_stacks)                   # not written
        return closed if new is None else _dce(new)

    def plan(self) -> bool:
        """Decide every site of this scope (nested ones folded); True if one folds. Calls a
        chain continues into (``jit``; first, checkpoints a chain crosses, as lowered) are
        inlined and the scope planned again, as StableHLO inlines a private ``func.call``."""
        first = len(self.sites)
        if (flat := products(inline_crossed(self.closed))) is not self.closed:
            self._index(flat, self.const_names)
        for _ in range(_MAX_INLINE_ROUNDS - 1):
            changed = self._plan_once()
            if not self.calls_reached:
                return changed
            del self.sites[first:]
            self._index(inline_calls(self.closed, self.calls_reached), self.const_names)
        return self._plan_once()

    def _plan_once(self) -> bool:
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
                self.child(branch, eqn.invars[1:], [False] * len(branch.jaxpr.invars),
                            "guard")
            elif contains_root(eqn):       # nested jaxprs without a root are left as they are
                changed |= self._plan_nested(i, eqn)
        self._account_unreached()
        return changed

    def _account_unreached(self) -> None:
        """A NOT_REACHED record for each ``mul`` of an activation by a per-channel vector of
        parameters that no root's chain took (see :mod:`hlofold._fold.core.unreached`)."""
        producer = lambda u: self.producer.get(u, (0, None))[1]
        taken = self.claimed | self.forward_taken
        for j, e in enumerate(self.jaxpr.eqns):
            if e.primitive.name != "mul" or j in taken:
                continue
            for pos in (0, 1):
                x = e.invars[pos]
                if not isinstance(x, C.Var) or len(x.aval.shape) < 2 or not self.from_root(x):
                    continue
                out = tuple(e.outvars[0].aval.shape)   # (x may broadcast: a per-token factor)
                op = next((r for r in (resolve_operand(e.invars[1 - pos], out, a, producer)
                                       for a in range(len(out)) if out[a] != 1)
                           if not isinstance(r, Refusal) and r.size > 1
                           and not self.from_root(r.source)), None)
                if op is None:
                    continue
                after = self._before_chain(x)
                if after in PATTERNS:        # the root's own record accounts for it
                    break
                then = self._after_chain(e.outvars[0])
                file, line, fn = C.user_location(e)
                self.sites.append(FoldSite(
                    pattern="unreached_affine", primitive="mul", status=NOT_REACHED,
                    scope=self.path, file=file, line=line, function=fn,
                    name_stack=C.name_stack(e), dtype=str(e.outvars[0].aval.dtype),
                    out_channels=op.size, params=sorted(n for n in self.names(op.source) if n),
                    reason=unreached_reason(after, then)))
                break

    def _after_chain(self, v) -> str | tuple[str, ...]:
        """Where ``v`` goes past the per-channel arithmetic and shape ops after it (a norm's
        own ``+ β``, a reshape): "output", or the primitives of its readers there."""
        for _ in range(10_000):
            uses = self.uses.get(v, [])
            if self.out_uses.get(v) or not uses:
                return "output"
            if len(uses) == 1:
                e = self.jaxpr.eqns[uses[0][0]]
                acts = [u for u in e.invars if isinstance(u, C.Var) and self.from_root(u)]
                if (len(acts) == 1 and len(e.outvars) == 1 and
                        (e.primitive.name in PASS_STEPS or e.primitive.name in AFFINE_STEPS)):
                    v = e.outvars[0]
                    continue
            return tuple(self.jaxpr.eqns[j].primitive.name for j, *_ in uses)
        return "output"     # pragma: no cover

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

    # ---- nested jaxprs

    def child(self, sub: C.ClosedJaxpr, outer: Sequence[Any], known_mask: Sequence[bool],
              label: str, values: Sequence[Any] | None = None,
              sites: list | None = None, scopes: list | None = None) -> C.ClosedJaxpr:
        """``sub`` (a nested jaxpr whose inputs are the ``outer`` atoms of this scope)
        folded: the inputs ``known_mask`` says are followed in with their values here, and
        ``values[k]`` (given, not None) is input ``k``'s value instead (a stack's slice for
        one layer). Records go to ``sites`` (default: this scope's), the scope to ``scopes``."""
        known_in, names_in, sources_in = [], [], []
        for k, (atom, kn) in enumerate(zip(outer, known_mask)):
            if values is not None and values[k] is not None:
                known_in.append(_const(values[k]))
            else:
                known_in.append((lambda a=atom: self.value(a)) if kn else NONE)
            names_in.append(lambda a=atom: self.names(a))
            sources_in.append(lambda a=atom: self.sources(a))
        child = _Scope(sub, known_in, names_in, [None] * len(sub.consts),
                       f"{self.path}/{label}", self.sites if sites is None else sites,
                       self.opts, sources_in)
        if scopes is not None:
            scopes.append(child)
        return child.fold()

    def _plan_nested(self, i, eqn) -> bool:
        """Fold the jaxprs ``eqn`` carries by its rule in ``NESTED_RULES``."""
        prim, params = eqn.primitive.name, eqn.params
        label = f"{prim}({params['name']})" if isinstance(params.get("name"), str) else prim
        try:
            new = NESTED_RULES.get(prim, other_rule)(self, eqn, label)
        except C.CompatError as e:    # its parameters are not what hlofold reads: left
            why = f"{e}; the {prim} at {self.path} is left as it is"
            if why not in self.opts.compat:
                self.opts.compat.append(why)
            return False
        if new is None:
            return False
        self.new_eqn[i] = new
        return True


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
    return C.closed_jaxpr(new, [c for c, u in zip(closed.consts, used) if u])
