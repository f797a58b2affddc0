"""Planning one jaxpr site: the chain after a root, the chain before it, and the decision.

:class:`SitePlanner` is the planning half of a jaxpr scope (``_fold.jaxpr.fold._Scope``). For a root
equation it walks the root's output through per-output-channel affine ops and shape ops
(``_fold.core.chain.walk`` over :class:`JaxprChain`, whose rule table :data:`JAXPR_STEPS` applies the
step rules of ``_base.chain_rules``), the root's input back
through per-input-channel affine ops (``_fold.jaxpr.forward.ForwardPlanner``), and decides with
the decision both paths share (``_fold.core.decide``): fold (constants computed now, in float64), fold
in the graph (guarded, prepared by the caller, or not at all: ``in_graph``), or refuse with a
reason. A chain that continues into a ``jit`` call is marked (``_call_rule``); the scope
inlines the call and plans again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._base.algebra import along, collapse, forward_kernel, has_shift, kinds
from hlofold._fold.core.chain import Absorb, Pass, affine_after, walk
from hlofold._fold.core.decide import decide, forward_refusal
from hlofold._fold.core.site import plan_site
from hlofold._base.chain_rules import ChannelOperand, Refusal, block_values
from .steps import AFFINE_STEPS, PASS_STEPS, AffineStep, PassStep, affine_step, pass_step
from .forward import Forward, ForwardPlanner, elems
from hlofold._fold.core.patterns import RootInfo
from hlofold._fold.core.cost import SiteCost, cost_refusal
from hlofold._base.report import FOLDED, LEFT, NO_PATTERN, REFUSED, FoldSite
from hlofold._base.reasons import Reason
from hlofold._fold.core.rules import WEIGHT_CONE, weight_like

# the jaxpr's ops of _fold.core.rules.WEIGHT_LAYOUT, by its names (other ops by their own)
_LAYOUT = ops.OPS.kinds("shape", {"cast": "convert", "transpose": "transpose",
                                  "reshape": "reshape"})

NOT_PREPARED = Reason("weights-not-known", "the parameters are not known at transform time "
                      "(traced under an enclosing transformation), so K·s would be recomputed "
                      "on every call; left unfolded — prepare outside your jit (Folded.split) "
                      "or pass in_graph=True")

IN_A_LOOP = Reason("weights-not-known", "the layer's parameters are not known layer by layer "
                   "at transform time (a loop body reads them at an index hlofold does not "
                   "follow, or from values it does not know), so K·s would be recomputed on "
                   "every iteration; left unfolded — freeze or bind the stacks (freeze=, "
                   "fold_params) with the rows read at a counter the loop carries, or pass "
                   "in_graph=True")


def _not_prepared(kernel, out, path: str = "top") -> str:
    """The reason a site with traced parameters stays unfolded, with what folding it in the
    graph would trade: |K| rescaled (and range-checked) per call against the epilogue over
    the output it removes, which XLA:CPU already fuses into the convolution. In a loop body
    (``path``) the parameters are not known per layer, which is not a trace of the user's."""
    if any(part.split("[")[0] in ("scan", "while") for part in path.split("/")[1:]):
        return IN_A_LOOP
    def size(aval) -> str:          # symbolic dimensions (jax.export) print as they are
        n = 1
        for d in aval.shape:
            n = n * d
        return str(n)
    return NOT_PREPARED.then(f" (in the graph: {size(kernel.aval)} kernel elements rescaled "
                             f"and checked per call, to remove an epilogue over "
                             f"{size(out.aval)} output elements)")



@dataclasses.dataclass
class Site:
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
    t_back: np.ndarray | None = None           # t without what a front shift adds
    has_shift: bool = False
    t_traced: Any = None                       # t computed in the graph (set while emitting)
    fwd: "Forward | None" = None              # affine folded in from *before* the root
    guard: bool = False                        # run-time check, original equations as fallback
    # float64 bias per output position (a shift in front of a padded conv), shaped like
    # the root's output with a batch of 1; replaces t
    bias_map: np.ndarray | None = None


class _JaxprSite:
    """A jaxpr scope's root read for ``_fold.core.site.plan_site`` (:class:`~hlofold._fold.
    core.site.SiteIR`): the scope, the root's index and its pattern."""

    def __init__(self, scope: "SitePlanner", i: int, pattern):
        self.scope, self.i, self.pattern = scope, i, pattern

    def reading(self, eqn):
        return self.pattern.inspect_root(eqn)

    def alternatives(self, eqn):
        return self.pattern.alternatives(eqn)

    def root_refusal(self, eqn):
        return None

    def kernel_known(self, eqn, info):
        return self.scope.value(eqn.invars[info.kernel_index]) is not None or \
            self.scope._weight_like(eqn, info.kernel_index)

    def walk(self, eqn, info):
        return walk(JaxprChain(self.scope, eqn, self.pattern), eqn.outvars[0],
                    info.channel_axis)

    def affine(self, steps):
        return [s for s in steps if isinstance(s, AffineStep)]

    def kernel_from_root(self, eqn, info):
        return self.scope.from_root(eqn.invars[info.kernel_index])

    def nothing(self, eqn, first):
        after = affine_after(JaxprChain(self.scope, eqn, self.pattern), eqn.outvars[0],
                             eqn.outvars[0].aval.ndim)
        self.scope._record(eqn, self.pattern, None, REFUSED if after else NO_PATTERN,
                           reason=first.reason)

    def claim(self, steps):
        self.scope.claimed.update(self.scope.producer[s.eqn.outvars[0]][0] for s in steps)

    def plan_forward(self, eqn, info):
        return self.scope._plan_forward(eqn, self.pattern, info)

    def record(self, eqn, info, status, **kw):
        return self.scope._record(eqn, self.pattern, info, status, **kw)

    def absorbed(self, steps):
        return [s.eqn.primitive.name for s in steps]

    def fold(self, eqn, info, w, steps, affine, fwd, backward):
        return self.scope._fold_site(self.i, eqn, self.pattern, info, w, steps, affine, fwd,
                                     backward)


class SitePlanner(ForwardPlanner):
    """Decides each root's site; records it in the report (``self._record``) and, when it
    folds, in the plan the emitter reads (``site_at_end``, ``skip``, ``claimed``)."""

    def _plan_site(self, i, eqn, pattern) -> bool:
        """Plan the site at the root ``eqn`` (the ``i``-th equation) by the procedure both
        paths share (``_fold.core.site.plan_site``)."""
        return plan_site(_JaxprSite(self, i, pattern), eqn)

    def _fold_site(self, i, eqn, pattern, info, w, steps, affine, fwd, backward) -> bool:
        """Step 7 of ``_fold.core.site``: the values now, the decision, the plan."""
        end_axis, stop = (w.axis if steps else info.channel_axis), w.stop
        absorbed = [s.eqn.primitive.name for s in steps]
        kernel = eqn.invars[info.kernel_index]
        kernel_names = sorted(n for n in self.names(kernel) if n)
        kfa = self.from_root(kernel)
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
        end_var = steps[-1].eqn.outvars[0] if steps else eqn.outvars[0]
        # Everything that is known at transform time is computed now, in float64.
        k_val = None if kfa else self.value(kernel)
        k64 = None if k_val is None else np.asarray(k_val)      # (rounded in float64 later)
        op_vals = [None if s.operand is None else self.operand_value(s.operand) for s in affine]
        s_vec = t_vec = None
        if all(v is not None for s, v in zip(affine, op_vals) if s.operand is not None):
            s_vec, t_vec = collapse(kinds(affine), op_vals, info.out_channels)
        if self.opts.cost is not None and not kfa and self._left_for_cost(
                eqn, info, kernel, k_val, affine, op_vals, fwd, backward, rec):
            return False
        b64, k_in = None, None
        if fwd is not None and not kfa:       # the forward fold's own rules (jaxpr only)
            if not self._check_forward(fwd, info, kd, hint,
                                       all_known=s_vec is not None and k64 is not None):
                if not backward:
                    return False
                fwd = None
            elif fwd.s_known is None:
                k64 = None     # the input scale is computed in the graph
            elif k64 is not None:
                k_in, b64 = self._forward_kernel(eqn, pattern, info, fwd, k64)
        site = Site(i, eqn, info, steps, self.producer[end_var][0], end_var, end_axis, rec,
                     has_shift=has_shift(affine) or (fwd is not None and fwd.has_shift),
                     fwd=fwd)
        sources = [kernel] + [st.operand.source for st in affine + (fwd.steps if fwd else [])
                              if isinstance(st, AffineStep) and st.operand is not None]
        dec = decide(kernel_dtype=kd, math_dtypes=[eqn.outvars[0].aval.dtype] + [
            st.eqn.outvars[0].aval.dtype for st in affine] if backward else [],
            s=s_vec, kernel=k64, kernel_axis=info.kernel_axis, in_graph=self.opts.in_graph,
            not_now=_not_prepared(kernel, end_var, self.path), kernel_from_activation=kfa,
            hint=hint,
            scale_known=s_vec is not None and (fwd is None or fwd.s_known is not None),
            subnormal=any(self.flushes(v) for v in sources),
            kernel_factors=[] if k_in is None else [k_in])
        if not dec.folds:
            if fwd is not None:
                self._refuse(fwd.record, dec.reason)
            return self._refuse(rec, dec.reason)
        site.s_known, site.t_known, site.t_back = s_vec, t_vec, t_vec
        site.kernel_const, site.guard = dec.kernel, dec.guard
        if b64 is not None and dec.kernel is not None:
            if fwd.masks is not None:
                # s·conv(pad(t), K) + t', added to the root's output (before its
                # shape-only steps), so nothing is left to add at the chain's end
                nd, ax = b64.ndim, info.channel_axis
                site.bias_map = along(s_vec, ax, nd) * b64 + along(t_vec, ax, nd)
                site.t_known, site.has_shift = None, False
            else:
                site.t_known = s_vec * b64 + t_vec
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.rescale, r.guarded = dec.rescale, dec.guard

        if steps:
            self.skip.add(i)
        for s in steps[:-1]:
            self.skip.add(self.producer[s.eqn.outvars[0]][0])
        self.site_at_end[site.end_idx] = site
        return True

    def _left_for_cost(self, eqn, info, kernel, k_val, affine, op_vals, fwd, backward,
                       rec) -> bool:
        """``hlofold.fold``'s cost rule (``_fold.core.cost``), before any kernel-sized work: a
        site whose parameters are inputs (prepared per value, or rescaled in the graph) or
        prepared constants (``opts.cost``: their names) folds only where it removes a pass;
        else its records say ``left``, with the figures. True: left."""
        names = set(self.names(kernel))
        for st in affine + (fwd.steps if fwd is not None else []):
            if st.operand is not None:
                names |= self.names(st.operand.source)
        unknown = k_val is None or any(v is None for s, v in zip(affine, op_vals)
                                       if s.operand is not None)
        if fwd is not None:
            unknown |= any(self.value(st.operand.source) is None for st in fwd.steps
                           if st.operand is not None)
        if not (unknown or names & self.opts.cost):
            return False                  # frozen constants: no copy held, no work added
        out = eqn.outvars[0].aval
        scales = [k for k in kinds(affine) if k in ("mul", "div", "neg", "rsub")]
        passes, removed, why = 0, 0, "the chain after the root only shifts"
        if backward:
            passes += bool(scales)
            removed += (len(affine) - has_shift(affine)) * elems(out.shape)
        if fwd is not None:
            fused = self._fused_with(fwd.source)
            passes += not fwd.tokens and fused is None
            removed += len(fwd.steps) * elems(fwd.source.aval.shape)
            why = ("the per-token factor x·r stays in the graph, its pass with it"
                   if fwd.tokens else f"the affine in front is computed in one loop with the "
                   f"{fused} producing its input")
        k = kernel.aval
        in_graph = k_val is None and self.opts.in_graph in ("guarded", "unguarded")
        cost = SiteCost(int(passes), int(removed),
                        0 if in_graph else elems(k.shape) * np.dtype(k.dtype).itemsize,
                        elems(k.shape) if in_graph else 0)
        reason = cost_refusal(cost, why)
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.cost = cost.to_dict()
                if reason is not None:
                    r.status, r.reason, r.rescale, r.guarded = LEFT, reason, None, False
        return reason is not None

    def _check_forward(self, fwd: Forward, info, kd, hint, all_known: bool) -> bool:
        """The forward fold's own rules (``_fold.core.decide.forward_refusal``), before the shared
        decision; ``fwd.s_known``/``t_known`` set when known. False: refused."""
        vals = [None if s.operand is None else self.operand_value(s.operand)
                for s in fwd.steps]
        known = all(v is not None for s, v in zip(fwd.steps, vals) if s.operand is not None)
        s_in = t_in = None
        if known:
            s_in, t_in = collapse(kinds(fwd.steps), vals, info.in_channels)
        why = forward_refusal(
            kernel_dtype=kd, step_dtypes=[st.eqn.outvars[0].aval.dtype for st in fwd.steps],
            hint=hint, bias_map=fwd.masks is not None, in_graph=self.opts.in_graph,
            all_known=known and all_known, s_in=s_in)
        if why:
            self._refuse(fwd.record, why)
        else:
            fwd.s_known, fwd.t_known = s_in, t_in
        return not why

    def _forward_kernel(self, eqn, pattern, info, fwd: Forward, k64):
        """What ``K`` is multiplied by for the known input scale, and the bias the input
        shift adds: per output channel, or a bias map (a padded convolution)."""
        return forward_kernel(k64, fwd.s_known, fwd.t_known, info.kernel_axis, fwd.k_in_axis,
                              fwd.groups, info.out_channels,
                              None if fwd.masks is None else
                              (lambda taps: pattern.bias_map(eqn, taps, fwd.masks)))

    def _weight_like(self, eqn, k: int) -> bool:
        """Operand ``k`` of ``eqn`` is the weight, not yet known (``_fold.core.rules.weight_like``)."""
        kinds = lambda v: None if (c := self.cone(v, limit=WEIGHT_CONE)) is None else [
            _LAYOUT.get(n, n) for n in (self.producer[u][1].primitive.name
                                        for u in c if u in self.producer)]
        return weight_like(lambda: kinds(eqn.invars[k]), self.from_root(eqn.invars[k]),
                           lambda: kinds(eqn.invars[1 - k]))

    def _kernel_dtype(self, kernel) -> np.dtype:
        """The dtype the folded kernel is rounded to."""
        kd = np.dtype(kernel.aval.dtype)
        if self.opts.float32_kernels and kd.itemsize < 4:
            return np.dtype(np.float32)
        return kd

    def _refuse(self, rec: FoldSite | None, reason: str) -> bool:
        if rec is not None:
            rec.status, rec.reason, rec.rescale, rec.guarded = REFUSED, reason, None, False
        return False

    def operand_value(self, op: ChannelOperand):
        """A per-channel operand's value (vector or scalar, its casts applied), if known."""
        val = self.value(op.source)
        if val is None:
            return None
        arr = np.asarray(val)
        for dt in op.casts:
            arr = arr.astype(np.dtype(dt))
        return block_values(op, arr.reshape(-1)) if op.source_axis is not None else \
            arr.reshape(())


class JaxprChain:
    """The jaxpr adapter of the chain walk (``_fold.core.chain.ChainIR``), for one root of a scope;
    what each primitive does to the chain is the rule table :data:`JAXPR_STEPS`."""

    def __init__(self, scope: "SitePlanner", root: C.JaxprEqn, pattern):
        self.scope, self.root, self.pattern = scope, root, pattern
        self.program = f"{scope.path} program"

    def uses(self, v):
        eqns = self.scope.jaxpr.eqns
        return ([(eqns[j], pos) for j, pos in self.scope.uses.get(v, ())],
                self.scope.out_uses.get(v, 0))

    def name(self, eqn) -> str:
        return eqn.primitive.name

    def result(self, eqn):
        return eqn.outvars[0]

    def describe(self, v) -> str:
        return v.aval.str_short()

    def step(self, eqn, pos, v, axis):
        rule = JAXPR_STEPS.get(eqn.primitive.name)
        return rule(self, eqn, pos, axis) if rule else f"chain ends at {eqn.primitive.name}"

    def peek(self, eqn, pos, v, axis):     # a call of any kind: it may take the chain on
        rule = JAXPR_STEPS.get(eqn.primitive.name)
        if rule is _call_rule or C.call_body(eqn)[1] is not None:
            return None
        return rule(self, eqn, pos, axis) if rule else "end"

    def from_root(self, v) -> bool:
        return self.scope.from_root(v)

    def joins_activation(self, eqn, pos, v) -> bool:
        return any(self.scope.is_activation(o, v) for k, o in enumerate(eqn.invars)
                   if k != pos)

    def explain_axis(self, axis: int) -> str:
        return self.pattern.explain_axis(self.root, axis)

    def producer(self, v):
        return self.scope.producer.get(v, (0, None))[1]


def _affine_rule(chain: JaxprChain, eqn, pos, axis):
    r = affine_step(eqn, pos, axis, chain.producer)
    if isinstance(r, Refusal):
        return r
    return Absorb(r, r.operand.source if r.operand is not None else None)


def _pass_rule(chain: JaxprChain, eqn, pos, axis):
    if pos != 0:
        return f"chain ends at {eqn.primitive.name}"
    r = pass_step(eqn, axis)
    if isinstance(r, Refusal):
        return r.reason
    cast = (eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype) \
        if eqn.primitive.name == "convert_element_type" else None
    return Pass(PassStep(eqn), r, cast)


def _call_rule(chain: JaxprChain, eqn, pos, axis):
    """A call (jit/pjit) whose body takes the chain on: the scope inlines it and plans
    again (``_fold.jaxpr.fold._Scope.plan``), as the StableHLO path inlines a private callee."""
    if not C.inlinable_call(eqn):      # its layouts or donations would be lost
        return f"chain ends at {eqn.primitive.name}"
    body = C.call_body(eqn)[1]
    v = body.jaxpr.invars[pos]
    readers = [e.primitive.name for e in body.jaxpr.eqns if any(a is v for a in e.invars)]
    readers += ["output"] * sum(o is v for o in body.jaxpr.outvars)
    if len(readers) == 1 and readers[0] in JAXPR_STEPS:
        chain.scope.calls_reached.add(chain.scope.producer[eqn.outvars[0]][0])
        return f"chain ends at {eqn.primitive.name}"
    return (f"chain ends at {eqn.primitive.name} (its argument feeds "
            f"{', '.join(readers) or 'nothing'})")     # a chain-end (``_fold.core.chain.walk``)


# what each primitive does to a chain that reaches it (others end the chain)
JAXPR_STEPS = {**{p: _affine_rule for p in AFFINE_STEPS}, **{p: _pass_rule for p in PASS_STEPS},
               **{p: _call_rule for p in C.JIT_NAMES}}
