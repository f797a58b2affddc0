"""Folding at the StableHLO level, for modules hlofold did not make.

TF, PyTorch/XLA, hand-written modules and plain ``jax.export`` artifacts carry BatchNorm as
``stablehlo.batch_norm_inference`` or as the decomposed arithmetic JAX and XLA emit
(``convolution → subtract/multiply/add/divide`` with ``broadcast_in_dim`` of per-channel
values, with ``convert`` casts). This pass walks every ``stablehlo.convolution`` (and
``stablehlo.dot_general`` and ``stablehlo.dot``), follows its result through such a chain
(``_fold.core.chain.walk``; into private functions that continue it), decides the site
(``_fold.core.decide``), collapses the chain into ``y·s + t`` and rewrites it to
``convolution(x, K ⊙ s) + broadcast_in_dim(t)``:

* operands that are constants (possibly computed from constants) give a new constant kernel
  and no multiply at all;
* operands that are function arguments give a multiply on the kernel, never on activations.

The rules are the jaxpr folder's: every folded value has one consumer, operands vary along
the output-feature dimension only (decided axis by axis, never by size; for
``batch_norm_inference`` its ``feature_index`` must *be* that dimension), and ``s`` must be
finite. Everything else is reported with a reason. Built on jaxlib's MLIR bindings; no text
is parsed by hand.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo import blobs
from hlofold._base.algebra import along, collapse, forward_kernel, per_channel
from hlofold._fold.core.chain import affine_after, walk
from hlofold._fold.core.decide import decide, forward_refusal
from hlofold._fold.core.site import plan_site
from .forward import HloForwardPlanner, conv_specs
from hlofold._ir.stablehlo.facts import op_facts
from hlofold._ir.stablehlo.ir import (PASS_KINDS, elem_type, float_dtype, is_float, location,
                                      op_name, owner_op, parent_of, shape_of, type_name)
from hlofold._ir.stablehlo.module import (drop_uncalled_private, erase_unused, functions,
                                          gc_paused, jax_const_arguments, parse_module)
from .match import UNREACHED_OPS, ChainWalker, HloChain
from .patterns import Evaluator, lhs_root_info, root_info, root_shapes
from .values import HloValues
from .emit import SiteWriter
from .merge_write import merge_module
from hlofold._ir.stablehlo.platforms import inline_uniform_cases
from hlofold._ir.stablehlo.indices import constant_counters
from .calls import inline_crossed_calls, inline_weighted_calls
from .canonical import products
from hlofold._ir.stablehlo.build import STACK, unmark
from .stacks import fold_stacks, stack_loops
from hlofold._fold.core.patterns import bias_map
from hlofold._base.chain_rules import channel_count
from hlofold._base.reasons import Reason
from hlofold._base.report import FOLDED, NO_PATTERN, REFUSED, FoldReport, FoldSite

ir, stablehlo, func_dialect = C.mlir()

# --------------------------------------------------------------------------- the pass


# the reason an argument-weight site stays unfolded with in_graph=False
WEIGHTS_ARE_ARGUMENTS = Reason(
    "weights-not-known",
    "the weights are module arguments, so K·s would be recomputed (and range-checked) on every "
    "call, costing more than the BatchNorm it removes; fold with the weight values "
    "(fold_stablehlo(..., params=), hlofold fold --params) or in the graph (in_graph=True, "
    "--in-graph)")

# the same, for a site in a loop body (a scanned layer stack: the weights are values the
# ``stablehlo.while`` carries, one slice read per iteration)
WEIGHTS_IN_LOOP = Reason(
    "weights-not-known",
    "the weights reach this site through a stablehlo.while (a scanned layer stack, one slice "
    "read per iteration) as module arguments, so K·s would be recomputed (and range-checked) "
    "on every iteration of every call; fold with the weight values (fold_stablehlo(..., "
    "params=), hlofold fold --params: each layer folds once and the loop reads the folded "
    "stacks) or in the graph (in_graph=True, --in-graph)")


# said with WEIGHTS_ARE_ARGUMENTS where @main marks arguments ``jax.const``
JAX_CONSTS = ("; {n} of @main's arguments are marked jax.const: constants JAX (0.12.1 and "
              "later) passes as arguments of a jitted function's lowering (Lowered.as_text()), "
              "their values not in the module — lower with jax.export (it keeps them in the "
              "module), or give their values with params=")


def enclosing_loop(op, calls: dict, seen: frozenset = frozenset()):
    """The ``stablehlo.while`` whose body ``op`` runs in (at any depth, or in a function
    called there; ``calls``: the module's :func:`call_sites`), or None."""
    p = parent_of(op)
    while p is not None:
        if p.name == "stablehlo.while":
            return p
        if p.name == "func.func":
            name = ir.StringAttr(p.attributes["sym_name"]).value
            if name in seen:
                return None
            return next((w for c in calls.get(name, ())
                         if (w := enclosing_loop(c, calls, seen | {name})) is not None), None)
        p = parent_of(p)
    return None


class _HloSite:
    """A module pass's root read for ``_fold.core.site.plan_site`` (:class:`~hlofold._fold.
    core.site.SiteIR`): the pass and the function the root is in."""

    def __init__(self, p: "_Pass", fname: str):
        self.p, self.fname = p, fname

    def reading(self, root):
        return root_info(root)

    def alternatives(self, root):
        lhs = lhs_root_info(root)
        return [] if lhs is None else [lhs]

    def root_refusal(self, root):
        return None if is_float(root.results[0]) else Reason("not-float", "not a float root")

    def kernel_known(self, root, info):
        return self.p.eval(root.operands[info.kernel_index]) is not None or \
            self.p.weight_like(root, info.kernel_index)

    def walk(self, root, info):
        return walk(HloChain(self.p, root, self.fname), root.results[0], info.channel_axis)

    def affine(self, steps):
        return [s for s in steps if s.kind not in PASS_KINDS]

    def kernel_from_root(self, root, info):
        k = root.operands[info.kernel_index]
        return owner_op(k) is not None and self.p._from_root(k)

    def nothing(self, root, first):
        after = affine_after(HloChain(self.p, root, self.fname), root.results[0],
                             len(root_shapes(root)[2]))
        self.p._record(root, self.fname, REFUSED if after else NO_PATTERN, reason=first)

    def claim(self, steps):
        self.p.claimed.update(s.op.operation for s in steps)

    def plan_forward(self, root, info):
        return self.p.plan_forward(root, info, self.fname)

    def record(self, root, info, status, **kw):
        return self.p._record(root, self.fname, info=info, status=status, **kw)

    def absorbed(self, steps):
        return [op_name(s.op).split(".")[-1] for s in steps]

    def fold(self, root, info, w, steps, affine, fwd, backward):
        self.p._fold_site(root, self.fname, info, w, steps, affine, fwd, backward)
        return True


class _Pass(ChainWalker, HloForwardPlanner, HloValues, SiteWriter):
    def __init__(self, module, in_graph: bool = True, guard: bool = True,
                 bound: dict | None = None, left: dict | None = None):
        self.in_graph = in_graph
        self.guard = guard
        self.module = module
        self.sites: list[FoldSite] = []
        self.eval = Evaluator(module, bound)
        self.left = left or {}        # loops whose layers do not fold alike: (reason, length)
        # value -> its lineage: the block arguments it is computed from (bits 1...) | from a
        # root (bit 0)
        self.lineage: dict[Any, int] = {}
        self.n_args = 0                            # block arguments given a bit so far
        self.invariant_memo: dict = {}             # _fold.core.forward_walk.invariant
        self.reads_memo: dict = {}                 # op with regions -> the values it reads
        # ops a folded site replaced: erased after all sites, so that no op is freed while
        # the memos (keyed by the ops' addresses) are in use
        self.dead: list = []
        # ops of an earlier root's chain (a later root's forward chain does not take them)
        self.claimed: set = set()
        self.forward_taken: set = set()    # ops of forward chains (any status)
        self.forward_memo: dict = {}       # (root input, axis, region) -> its forward chain
        self.chain_shared: dict = {}       # id(chain's steps) -> (steps, shared_by_chain's)
        self.shape_memo: dict = {}         # value -> its shape (the forward walk's)
        self.replaced: dict = {}           # op ending a folded site -> the name of the old one
        self.written: set = set()          # roots and per-token ops folds wrote (not
        #                                    readers in the program as written)
        self.token_inputs: dict = {}       # (source, per-token values, kinds) -> x·r
        self.inlined: set[str] = set()     # private callees inlined into a caller
        self.trial: list = []              # calls inlined while walking the current site
        self.ct = None                     # in-graph arithmetic type of the current site
        self.guard_parts: dict = {}        # what guards reuse: reductions by rank, a true
        #                                    per block (build.all_finite), the marker
        self.args_reason = None            # _not_now's reason outside loops (jax.const)
        self.symbols = {}
        for op in module.body.operations:
            if op_name(op) == "func.func":
                self.symbols[ir.StringAttr(op.attributes["sym_name"]).value] = op

    def run(self) -> FoldReport:
        with op_facts():           # (no op is erased inside but by an undone trial)
            dead = self._sites()
        inputs = [p for op in self.dead for p in map(owner_op, op.operands)
                  if p is not None and p not in dead]
        for op in self.dead:
            op.erase()
        erase_unused(inputs)       # what computed only their operands (nothing else is read)
        for memo in (self.dead, self.claimed, self.replaced, self.written, self.token_inputs,
                     self.lineage, self.invariant_memo, self.reads_memo, self.forward_memo,
                     self.chain_shared, self.shape_memo, self.eval.memo, self.eval.flushed):
            memo.clear()         # they may name erased ops: not read after the sites
        return FoldReport(self.sites)

    def _sites(self) -> set:
        """Fold every root, account for what no root reached; returns the ops folds
        replaced (erased after)."""
        affines = {}          # function -> its ops the unreached accounting looks at
        for fname, fop in list(self.symbols.items()):
            if not fop.regions[0].blocks:      # a declaration: no body to fold
                continue
            affines[fname], roots = [], []
            self._sweep(fop, roots, UNREACHED_OPS, affines[fname])
            runs = len(self.eval.calls.get(fname, ())) if fname != "main" else 1
            for op in roots:
                n = len(self.sites)
                self._site(op, fname)
                if self._end_trial(any(r.status == FOLDED for r in self.sites[n:])):
                    affines[fname] = None      # inlined ops: look at the program again
                for r in self.sites[n:]:       # a function called per layer: each of its
                    if runs > 1 and not r.layers:   # sites runs once per call (conv×N)
                        r.layers = runs
        # accounted before the replaced ops are erased: the lineage stays valid
        dead = {op.operation for op in self.dead}
        for fname, fop in list(self.symbols.items()):
            if fname in affines and fname not in self.inlined:
                self._account_unreached(fop, fname, affines[fname], dead)
        return dead

    def _record(self, op, fname, status, info=None, pattern=None, **kw) -> FoldSite:
        file, line, name = location(op)
        shape = root_shapes(op)[2]
        info = info or root_info(op)
        pattern = pattern or ("stablehlo_" + ("conv" if "conv" in op_name(op) else "dot") +
                              "_affine")
        rec = FoldSite(pattern=pattern, primitive=op_name(op), status=status, scope=f"@{fname}",
                       file=file, line=line, name_stack=name,
                       dtype=type_name(elem_type(op.results[0])), **kw)
        if not isinstance(info, str):
            rec.layout, rec.in_channels, rec.groups = info.layout, info.in_channels, info.groups
            rec.out_channels = channel_count(shape, info.channel_axis)
        self.sites.append(rec)
        return rec

    # -- folding

    def _site(self, root, fname):
        """Fold the site at ``root`` by the procedure both paths share
        (``_fold.core.site.plan_site``)."""
        plan_site(_HloSite(self, fname), root)

    def _fold_site(self, root, fname, info, w, steps, real, fwd, backward):
        """Step 7 of ``_fold.core.site``: the values now, the decision, the rewrite."""
        stop = w.stop
        out_axis, kidx, kaxis = info.channel_axis, info.kernel_index, info.kernel_axis
        absorbed = [op_name(s.op).split(".")[-1] for s in steps]
        kernel = root.operands[kidx]
        C_out = channel_count(root_shapes(root)[2], out_axis)
        kfa = owner_op(kernel) is not None and self._from_root(kernel)
        # (kinds, float64 operands) or None; not read for a kernel computed from an
        # activation, which decide refuses first
        known = None if kfa else self.np_chain(real, C_out)
        rec = self._record(root, fname, info=info, status=FOLDED, absorbed=absorbed,
                           note=f"chain stopped: {stop}" if stop else None) if backward else None
        kd = float_dtype(elem_type(kernel))
        if kd is None:
            return self._refuse(rec, fwd, Reason(
                "not-float", f"the kernel is {elem_type(kernel)}, not a float"))
        end_value = steps[-1].op.results[0] if steps else root.results[0]
        # in-graph arithmetic: float32, or float64 when the program computes in float64
        f64 = ir.F64Type.get()
        wide = any(elem_type(v) == f64 for v in (kernel, root.results[0], end_value))
        self.ct = f64 if wide else ir.F32Type.get()
        s_vec = t_vec = None
        if known and known[0]:
            with np.errstate(all="ignore"):
                s_vec, t_vec = (per_channel(v, C_out) for v in collapse(*known, C_out))
        elif known:             # nothing after the root: s = 1, t = 0
            s_vec, t_vec = np.ones(C_out), np.zeros(C_out)
        k_np = None if kfa else self.eval(kernel)
        k_np = None if k_np is None else np.asarray(k_np)      # (rounded in float64 later)
        policy = "never" if not self.in_graph else "guarded" if self.guard else "unguarded"
        b64 = k_in = None
        if fwd is not None and not kfa:
            fwd, k_np, k_in, b64 = self._check_forward(root, fwd, info, kd, policy, k_np,
                                                       s_vec is not None)
            if fwd is None and not backward:
                return
        # the types the chain computes in (a value passed through a type is not computed in it)
        math = [float_dtype(elem_type(v.results[0])) for v in [root] + [st.op for st in real]]
        dec = decide(kernel_dtype=kd, math_dtypes=[d for d in math if d is not None]
                     if backward else [], s=s_vec, kernel=k_np if s_vec is not None else None,
                     kernel_axis=kaxis, in_graph=policy,
                     not_now=self._not_now(root, rec, fwd),
                     kernel_from_activation=kfa,
                     scale_known=s_vec is not None and (fwd is None or fwd.s_known is not None),
                     subnormal=self.flushes([kernel], real + (fwd.steps if fwd else [])),
                     kernel_factors=[] if k_in is None else [k_in])
        if not dec.folds:
            return self._refuse(rec, fwd, dec.reason)
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.rescale, r.guarded = dec.rescale, dec.guard
        bmap, add_t = None, True
        if b64 is not None and dec.kernel is not None:
            if fwd.masks is not None:      # s·conv(pad(t), K) + t', added to the root's output
                nd = len(shape_of(root.results[0]))
                bmap = along(s_vec, out_axis, nd) * b64 + along(t_vec, out_axis, nd)
                add_t = False
            else:
                t_vec = s_vec * b64 + t_vec
        self._rewrite(root, steps, real, info, fwd, dec, known, s_vec, t_vec, bmap, add_t)

    def _not_now(self, root, rec, fwd) -> Reason:
        """Why a site whose weights are not known now is not folded now: they are module
        arguments, or a loop's per-iteration values (a stack whose layers differ: that)."""
        loop = enclosing_loop(root, self.eval.calls)
        if loop is None:
            if self.args_reason is None:        # (once: @main's jax.const arguments)
                main = self.symbols.get("main")
                n = 0 if main is None else len(jax_const_arguments(main))
                self.args_reason = WEIGHTS_ARE_ARGUMENTS.then(JAX_CONSTS.format(n=n) if n
                                                              else "")
            return self.args_reason
        why, length = self.left.get(loop, (WEIGHTS_IN_LOOP, None))
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None and length:
                r.layers = length
        return why

    def _check_forward(self, root, fwd, info, kd, policy, k_np, s_known: bool):
        """The forward fold's own rules (``_fold.core.decide.forward_refusal``); returns ``(fwd or None
        when refused, the kernel known now or None, what it is multiplied by for s_in, the
        bias the shift adds)``."""
        c_in, c_out = info.in_channels, channel_count(root_shapes(root)[2], info.channel_axis)
        fv = self.np_chain(fwd.steps, c_in)
        s_in = t_in = None
        if fv is not None:
            with np.errstate(all="ignore"):
                s_in, t_in = collapse(*fv, c_in)
        why = forward_refusal(
            kernel_dtype=kd, step_dtypes=[float_dtype(elem_type(st.op.results[0]))
                                          for st in fwd.steps], hint="",
            bias_map=fwd.masks is not None, in_graph=policy,
            all_known=fv is not None and s_known and k_np is not None, s_in=s_in)
        if why:
            fwd.record.status, fwd.record.reason = REFUSED, why
            return None, k_np, None, None
        fwd.s_known, fwd.t_known = s_in, t_in
        if s_in is None or k_np is None:
            return fwd, None, None, None      # the input scale is computed in the graph
        k_in, b64 = forward_kernel(k_np, s_in, t_in, info.kernel_axis, fwd.k_in_axis,
                                   fwd.groups, c_out, None if fwd.masks is None else
                                   (lambda taps: bias_map(taps, fwd.masks, *conv_specs(root))))
        return fwd, k_np, k_in, b64

    @staticmethod
    def _refuse(rec, fwd, reason) -> None:
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.status, r.reason, r.rescale, r.guarded = REFUSED, reason, None, False


def fold_module(module, in_graph: bool = True, guard: bool = True,
                merge: bool = True, bound: dict | None = None) -> FoldReport:
    """Fold ``module`` in place (call inside its context); returns the report.
    ``in_graph``: fold sites whose weights are arguments with the rescale in the graph,
    guarded (else refuse them with :data:`WEIGHTS_ARE_ARGUMENTS`); ``guard=False``: without
    the run-time guard, the folded kernels and biases marked ``PREPARED`` for the
    caller to check (see :mod:`hlofold._fold.stablehlo.split`)."""
    with blobs.scope(module):        # large constants made here held by reference
        return _fold_module(module, in_graph, guard, merge, bound)


def _fold_module(module, in_graph: bool, guard: bool, merge: bool,
                 bound: dict | None) -> FoldReport:
    inline_uniform_cases(module)     # a multi-platform module's per-platform copies
    products(module)                 # a scale applied by a dot that contracts nothing
    constant_counters(module)        # an unrolled scan's last layers: their rows known
    if inline_weighted_calls(module, Evaluator(module, bound)) + \
            inline_crossed_calls(module):   # a jit block per layer; a helper a fold crosses
        drop_uncalled_private(module)
    symbols = functions(module)
    with gc_paused():                # scanned stacks, per layer (each a module of its own)
        stacked, left = fold_stacks(module, symbols, lambda m, given: fold_module(
            m, in_graph, guard, merge, bound=given), bound, staged=in_graph and not guard)
        folder = _Pass(module, in_graph, guard, bound, left)
        report = folder.run()
        report.sites[:0] = stacked
        for w in stack_loops(module):
            unmark(w, STACK)
        inlined = folder.inlined
        del folder              # (its memos hold a wrapper per op: dropped while paused)
    if inlined:                 # private functions whose calls were all inlined
        drop_uncalled_private(module, only=inlined)
    if merge:
        with gc_paused():       # sums of parallel branches, each as one convolution
            merge_module(module, functions(module), report.sites,
                         staged=in_graph and not guard, bound=bound)
    if not module.operation.verify():
        raise AssertionError("hlofold produced an invalid module")   # pragma: no cover
    return report


def fold_module_text(text_or_bytes, in_graph: bool = True,
                     merge: bool = True) -> tuple[Any, FoldReport]:
    """Parse, fold and return ``(module, report)`` (module in hlofold's MLIR context)."""
    module = parse_module(text_or_bytes)
    with module.context, ir.Location.unknown():
        report = fold_module(module, in_graph, merge=merge)
    return module, report


