"""Folding at the StableHLO level, for modules hlofold did not make.

TF, PyTorch/XLA, hand-written modules and plain ``jax.export`` artifacts carry BatchNorm as
``stablehlo.batch_norm_inference`` or as the decomposed arithmetic JAX and XLA emit
(``convolution → subtract/multiply/add/divide`` with ``broadcast_in_dim`` of per-channel
values, with ``convert`` casts). This pass walks every ``stablehlo.convolution`` (and
``stablehlo.dot_general`` and ``stablehlo.dot``), follows its result through such a chain
(``_core.chain.walk``; into private functions that continue it), decides the site
(``_core.decide``), collapses the chain into ``y·s + t`` and rewrites it to
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

from .. import _compat as C
from .._core.algebra import along, collapse, exact_f64, forward_kernel, per_channel
from .._core.chain import UNUSED, chain_kind, walk
from .._core.decide import chain_status, decide, forward_refusal
from .forward import HloForwardPlanner, conv_specs
from .ir import (GUARD_ATTR, PASS_KINDS, IrArith, all_finite, elem_type, float_dtype,
                 is_float, location, numpy_to_dense, op_name, owner_op, remap_operands,
                 roots_in, shape_of)
from .module import drop_uncalled_private, erase_unused, parse_module
from .match import UNREACHED_OPS, ChainWalker, HloChain
from .patterns import Evaluator, lhs_root_info, root_info
from .values import HloValues
from .._core.patterns import bias_map
from .._core.reasons import Reason
from .._core.report import CANONICAL, FOLDED, REFUSED, FoldReport, FoldSite

ir, stablehlo, func_dialect = C.mlir()

# --------------------------------------------------------------------------- the pass


# the reason an argument-weight site stays unfolded with in_graph=False
WEIGHTS_ARE_ARGUMENTS = Reason(
    "weights-not-known",
    "the weights are module arguments, so K·s would be recomputed (and range-checked) on every "
    "call, costing more than the BatchNorm it removes; fold with the weight values "
    "(fold_stablehlo(..., params=), hlofold fold --params) or in the graph (in_graph=True, "
    "--in-graph)")


class _Pass(ChainWalker, HloForwardPlanner, HloValues):
    def __init__(self, module, in_graph: bool = True, guard: bool = True):
        self.in_graph = in_graph
        self.guard = guard
        self.module = module
        self.sites: list[FoldSite] = []
        self.eval = Evaluator(module)
        self.activation: dict[Any, bool] = {}
        # ops a folded site replaced: erased after all sites, so that no op is freed while
        # the memos (keyed by the ops' addresses) are in use
        self.dead: list = []
        # ops of an earlier root's chain (a later root's forward chain does not take them)
        self.claimed: set = set()
        self.forward_taken: set = set()    # ops of forward chains (any status)
        self.replaced: dict = {}           # op ending a folded site -> the name of the old one
        self.written: set = set()          # roots and per-token ops folds wrote (not
        #                                    readers in the program as written)
        self.token_inputs: dict = {}       # (source, per-token values, kinds) -> x·r
        self.inlined: set[str] = set()     # private callees inlined into a caller
        self.trial: list = []              # calls inlined while walking the current site
        self.ct = None                     # in-graph arithmetic type of the current site
        self.finite_made: dict = {}        # guards' reductions by rank (cloned: _hlo_ir)
        self.symbols = {}
        for op in module.body.operations:
            if op_name(op) == "func.func":
                self.symbols[ir.StringAttr(op.attributes["sym_name"]).value] = op

    def run(self) -> FoldReport:
        affines = {}          # function -> its ops the unreached accounting looks at
        for fname, fop in list(self.symbols.items()):
            if not fop.regions[0].blocks:      # a declaration: no body to fold
                continue
            affines[fname] = []
            for op in roots_in(fop, UNREACHED_OPS, affines[fname]):
                n = len(self.sites)
                self._site(op, fname)
                if self._end_trial(any(r.status == FOLDED for r in self.sites[n:])):
                    affines[fname] = None      # inlined ops: look at the program again
        # accounted before the replaced ops are erased: the activation memo stays valid
        dead = {op.operation for op in self.dead}
        for fname, fop in list(self.symbols.items()):
            if fname in affines and fname not in self.inlined:
                self._account_unreached(fop, fname, affines[fname], dead)
        inputs = [p for op in self.dead for p in map(owner_op, op.operands)
                  if p is not None and p not in dead]
        for op in self.dead:
            op.erase()
        erase_unused(inputs)       # what computed only their operands (nothing else is read)
        for memo in (self.dead, self.claimed, self.replaced, self.written, self.token_inputs,
                     self.activation, self.eval.memo):
            memo.clear()         # they may name erased ops: not read after the sites
        return FoldReport(self.sites)

    def _record(self, op, fname, status, info=None, pattern=None, **kw) -> FoldSite:
        file, line, name = location(op)
        shape = shape_of(op.results[0])
        info = info or root_info(op)
        pattern = pattern or ("stablehlo_" + ("conv" if "conv" in op_name(op) else "dot") +
                              "_affine")
        rec = FoldSite(pattern=pattern, primitive=op_name(op), status=status, scope=f"@{fname}",
                       file=file, line=line, name_stack=name,
                       dtype=str(elem_type(op.results[0])), **kw)
        if not isinstance(info, str):
            rec.layout, rec.in_channels, rec.groups = info[3], info[4], info[5]
            rec.out_channels = int(shape[info[0]])
        self.sites.append(rec)
        return rec

    # -- folding

    def _site(self, root, fname):
        first = root_info(root)
        cands = [c for c in (first, lhs_root_info(root)) if c is not None and
                 not isinstance(c, str)]
        if not cands:
            self._record(root, fname, REFUSED, reason=first)
            return
        if not is_float(root.results[0]):
            self._record(root, fname, REFUSED, reason=Reason("not-float", "not a float root"))
            return
        chosen = None
        for info in cands:              # the first reading of the root that folds
            if info is not first and self.eval(root.operands[info[1]]) is None and \
                    not self.weight_like(root, info[1]):
                continue     # another reading only for a weight: an input on the lhs may as
                # well be the activations
            w = walk(HloChain(self, root, fname), root.results[0], info[0])
            k = root.operands[info[1]]
            folds = chain_kind(s.kind for s in w.steps if s.kind not in PASS_KINDS) == \
                "fold" and not (owner_op(k) is not None and self._from_root(k))
            if chosen is None or folds:
                chosen = (info, w)
            if folds:
                break
        if chosen is None:
            self._record(root, fname, REFUSED, reason=first)
            return
        info, w = chosen
        steps, stop, refusal = w.steps, w.stop, w.refusal
        out_axis, kidx, kaxis = info[:3]
        absorbed = [op_name(s.op).split(".")[-1] for s in steps]
        real = [s for s in steps if s.kind not in PASS_KINDS]
        status, reason = chain_status((s.kind for s in real), stop, refusal)
        self.claimed.update(s.op.operation for s in steps)
        fwd = self.plan_forward(root, info, fname)
        backward = status == FOLDED
        if not backward:
            if status == CANONICAL:
                self._record(root, fname, info=info, status=status, reason=reason,
                             absorbed=absorbed)
            elif not (fwd is not None and stop == UNUSED):
                self._record(root, fname, info=info, status=status, reason=reason)
            if fwd is None:
                return
            if not real:
                steps = []
            # else: a canonical bias after the root merges into the forward fold's bias
        kernel = root.operands[kidx]
        C_out = shape_of(root.results[0])[out_axis]
        known = self.np_chain(real, C_out)      # (kinds, float64 operands) or None
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
        if known:
            with np.errstate(all="ignore"):
                s_vec, t_vec = (per_channel(v, C_out) for v in collapse(*known, C_out))
        kfa = owner_op(kernel) is not None and self._from_root(kernel)
        k_np = None if kfa else self.eval(kernel)
        k_np = None if k_np is None else exact_f64(np.asarray(k_np))
        policy = "never" if not self.in_graph else "guarded" if self.guard else "unguarded"
        b64 = None
        if fwd is not None and not kfa:
            fwd, k_np, b64 = self._check_forward(root, fwd, info, kd, policy, k_np,
                                                 s_vec is not None)
            if fwd is None and not backward:
                return
        math = [float_dtype(elem_type(v.results[0])) for v in [root] + [st.op for st in steps]]
        dec = decide(kernel_dtype=kd, math_dtypes=[d for d in math if d is not None]
                     if backward else [], s=s_vec, kernel=k_np if s_vec is not None else None,
                     kernel_axis=kaxis, not_now=WEIGHTS_ARE_ARGUMENTS, in_graph=policy,
                     kernel_from_activation=kfa,
                     scale_known=s_vec is not None and (fwd is None or fwd.s_known is not None))
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

    def _check_forward(self, root, fwd, info, kd, policy, k_np, s_known: bool):
        """The forward fold's own rules (``_core.decide.forward_refusal``); returns ``(fwd or None
        when refused, the kernel known now (rescaled by s_in) or None, the bias it adds)``."""
        c_in, c_out = info[4], shape_of(root.results[0])[info[0]]
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
            return None, k_np, None
        fwd.s_known, fwd.t_known = s_in, t_in
        if s_in is None:
            return fwd, None, None          # the input scale is computed in the graph
        if k_np is None:
            return fwd, None, None
        k_np, b64 = forward_kernel(k_np, s_in, t_in, info[2], fwd.k_in_axis, fwd.groups, c_out,
                                   None if fwd.masks is None else
                                   (lambda taps: bias_map(taps, fwd.masks, *conv_specs(root))))
        return fwd, k_np, b64

    @staticmethod
    def _refuse(rec, fwd, reason) -> None:
        for r in (rec, fwd.record if fwd is not None else None):
            if r is not None:
                r.status, r.reason, r.rescale, r.guarded = REFUSED, reason, None, False

    def _rewrite(self, root, steps, real, info, fwd, dec, known, s_vec, t_vec, bmap, add_t):
        """Replace the site's ops: ``root(x, K')`` (+ bias map), the chain's casts and shape
        ops, ``+ t``; in the graph, guarded: an ``if`` that runs the original ops when the
        folded kernel or bias is not finite."""
        out_axis, kidx, kaxis = info[:3]
        kernel = root.operands[kidx]
        C_out = shape_of(root.results[0])[out_axis]
        end_op = steps[-1].op if steps else root
        end_value = end_op.results[0]
        kdt = elem_type(kernel)
        out_t = end_value.type
        # first, before anything this site writes: x·r, before the root
        x = None if fwd is None else self._token_input(fwd, root)
        with ir.Location.unknown(), ir.InsertionPoint(end_op):
            s_val, t_val = (s_vec, t_vec) if known else collapse(
                *self.ir_chain(real, C_out), C_out, xp=IrArith(C_out, self.ct))
            if dec.kernel is not None:
                new_k = stablehlo.ConstantOp(numpy_to_dense(dec.kernel, kdt)).result
            else:
                kc = self.convert(kernel, self.ct)
                if fwd is not None:
                    kc, b = self.forward_kernel_ir(kc, fwd, info, C_out)
                    if b is not None:     # the bias the input shift adds, through the chain
                        xp = IrArith(C_out, self.ct)
                        t_val = xp.add(xp.mul(xp.asarray(s_val), b), xp.asarray(t_val))
                s_ir = self.const_or(s_val, C_out)
                s_b = stablehlo.BroadcastInDimOp(
                    ir.RankedTensorType.get(shape_of(kernel), self.ct), s_ir,
                    ir.DenseI64ArrayAttr.get([kaxis])).result
                new_k = self.convert(stablehlo.MulOp(kc, s_b).result, kdt)
            t_of = lambda: self.convert(self.const_or(t_val, C_out), elem_type(end_value))
            guard = dec.guard        # s is known only at run time: check it there
            if not known or (fwd is not None and fwd.s_known is None):
                if not self.guard:     # the caller checks these (hlofold._stablehlo.split)
                    new_k = self.mark_prepared(new_k)
                    t_ir = self.mark_prepared(t_of())
                    t_of = lambda: t_ir
            fold = dict(root=root, steps=steps, info=info, fwd=fwd, x=x, new_k=new_k,
                        out_t=out_t, bmap=bmap, add_t=add_t)
            if not guard:
                new_out = self._folded_ops(t_of=t_of, **fold)
            else:
                t_ir = t_of()
                t_of = lambda: t_ir
                # run-time guard: a non-finite folded kernel or bias (σ² = 0 with ε = 0, an
                # inf γ) runs the site's original ops instead
                pred = stablehlo.AndOp(all_finite(new_k, self.finite_made),
                                       all_finite(t_ir, self.finite_made)).result
                if_op = stablehlo.IfOp([out_t], pred)
                if_op.operation.attributes[GUARD_ATTR] = ir.UnitAttr.get()
                with ir.InsertionPoint(if_op.true_branch.blocks.append()):
                    stablehlo.ReturnOp([self._folded_ops(t_of=t_of, **fold)])
                with ir.InsertionPoint(if_op.false_branch.blocks.append()):
                    mapping, last = {}, None
                    for op in [root] + [st.op for st in steps]:
                        new = op.clone()
                        remap_operands(new, mapping)
                        mapping[op.results[0]] = last = new.results[0]
                    stablehlo.ReturnOp([last])
                new_out = if_op.results[0]
        end_value.replace_all_uses_with(new_out)
        # the rules of later sites read the program as written (the jaxpr path plans on the
        # original equations): the op now producing the site's value stands for its old one
        self.replaced[owner_op(new_out).operation] = op_name(end_op)
        self.dead.extend([s.op for s in reversed(steps)] + [root])

    def _folded_ops(self, root, steps, info, fwd, x, new_k, t_of, out_t, bmap, add_t):
        """``root(x, new_k)`` (``x``: before the forward chain, times its per-token factors;
        None: the root's own input), plus the bias map, the chain's casts and shape ops
        replayed, plus ``broadcast(t_of())``; the final op is claimed (a later root's forward
        chain does not take it)."""
        new_root = root.clone()           # (its attributes and location, as one call)
        new_root.operands[info[1]] = new_k
        if x is not None:
            new_root.operands[fwd.act] = x
        y = new_root.results[0]
        self.written.add(new_root.operation)
        if bmap is not None:          # broadcast over the batch
            etype = elem_type(y)
            m = stablehlo.ConstantOp(numpy_to_dense(bmap, etype)).result
            y = stablehlo.AddOp(y, stablehlo.BroadcastInDimOp(
                y.type, m, ir.DenseI64ArrayAttr.get(list(range(len(shape_of(y)))))).result
            ).result
        for s in steps:        # replay the casts and shape ops of the chain on the new result
            if s.kind == "convert":
                y = self.convert(y, elem_type(s.op.results[0]))
            elif s.kind == "shape":
                new = s.op.clone()
                new.operands[0] = y
                y = new.results[0]
        if add_t:
            axis = steps[-1].axis if steps else info[0]
            t_b = stablehlo.BroadcastInDimOp(out_t, t_of(),
                                             ir.DenseI64ArrayAttr.get([axis])).result
            y = stablehlo.AddOp(y, t_b).result
        if owner_op(y) is not None:
            self.claimed.add(owner_op(y).operation)
        return y

    def _token_input(self, fwd, root):
        """The root's new input: the chain's source through its per-token ops (``x·r``),
        written once per source and kept factors, just before the first root reading it
        (later roots reading the same normalized value, Q/K/V, sit after it in the same
        block and read the same op)."""
        if not fwd.tokens:
            return fwd.source
        key = (fwd.source, *(w for _, w in fwd.tokens), *(k for k, _ in fwd.tokens))
        x = self.token_inputs.get(key)
        if x is None:
            x = fwd.source
            with ir.Location.unknown(), ir.InsertionPoint(root):
                for kind, w in fwd.tokens:    # per-token ops stay: the root reads x·r
                    x = (stablehlo.MulOp if kind == "mul" else stablehlo.AddOp)(x, w).result
                    self.written.add(owner_op(x).operation)
            self.token_inputs[key] = x
        return x


def fold_module(module, in_graph: bool = True, guard: bool = True) -> FoldReport:
    """Fold ``module`` in place (call inside its context); returns the report.
    ``in_graph``: fold sites whose weights are arguments with the rescale in the graph,
    guarded (else refuse them with :data:`WEIGHTS_ARE_ARGUMENTS`); ``guard=False``: without
    the run-time guard, the folded kernels and biases marked :data:`PREPARED_ATTR` for the
    caller to check (see :mod:`hlofold._stablehlo.split`)."""
    folder = _Pass(module, in_graph, guard)
    report = folder.run()
    if folder.inlined:          # private functions whose calls were all inlined
        drop_uncalled_private(module, only=folder.inlined)
    if not module.operation.verify():
        raise AssertionError("hlofold produced an invalid module")   # pragma: no cover
    return report


def fold_module_text(text_or_bytes, in_graph: bool = True) -> tuple[Any, FoldReport]:
    """Parse, fold and return ``(module, report)`` (module in hlofold's MLIR context)."""
    module = parse_module(text_or_bytes)
    with module.context, ir.Location.unknown():
        report = fold_module(module, in_graph)
    return module, report


