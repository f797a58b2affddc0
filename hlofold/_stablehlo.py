"""Folding at the StableHLO level, for modules hlofold did not make.

TF, PyTorch/XLA, hand-written modules and plain ``jax.export`` artifacts carry BatchNorm as
``stablehlo.batch_norm_inference`` or as the decomposed arithmetic JAX and XLA emit
(``convolution → subtract/multiply/add/divide`` with ``broadcast_in_dim`` of per-channel
values, with ``convert`` casts). This pass walks every ``stablehlo.convolution`` (and
``stablehlo.dot_general`` and ``stablehlo.dot``), follows its result through such a chain
(``_chain.walk``; into private functions that continue it), decides the site
(``_decide``), collapses the chain into ``y·s + t`` and rewrites it to
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

from . import _compat as C
from ._algebra import collapse
from ._chain import chain_kind, walk
from ._hlo_ir import (GUARD_ATTR, PASS_KINDS, PREPARED_ATTR, IrArith, all_finite, dce,
                      elem_type, float_dtype, is_float, location, np_dtype, numpy_to_dense,
                      op_name, owner_op, parse_module, remap_operands, roots_in, shape_of)
from ._hlo_match import ChainWalker, HloChain
from ._hlo_patterns import Evaluator, Operand, lhs_root_info, root_info
from ._report import CANONICAL, FOLDED, REFUSED, FoldReport, FoldSite
from ._decide import chain_status, decide
from ._reasons import Reason

ir, stablehlo, func_dialect = C.mlir()

# --------------------------------------------------------------------------- the pass


# the reason an argument-weight site stays unfolded with in_graph=False
WEIGHTS_ARE_ARGUMENTS = Reason(
    "weights-not-known",
    "the weights are module arguments, so K·s would be recomputed (and range-checked) on every "
    "call, costing more than the BatchNorm it removes; fold with the weight values "
    "(fold_stablehlo(..., params=), hlofold fold --params) or in the graph (in_graph=True, "
    "--in-graph)")


class _Pass(ChainWalker):
    def __init__(self, module, in_graph: bool = True, guard: bool = True):
        self.in_graph = in_graph
        self.guard = guard
        self.module = module
        self.sites: list[FoldSite] = []
        self.eval = Evaluator()
        self.activation: dict[Any, bool] = {}
        # ops a folded site replaced: erased after all sites, so that no op is freed while
        # the memos (keyed by the ops' addresses) are in use
        self.dead: list = []
        self.inlined: set[str] = set()     # private callees inlined into a caller
        self.trial: list = []              # calls inlined while walking the current site
        self.ct = None                     # in-graph arithmetic type of the current site
        self.symbols = {}
        for op in module.body.operations:
            if op_name(op) == "func.func":
                self.symbols[ir.StringAttr(op.attributes["sym_name"]).value] = op

    def run(self) -> FoldReport:
        for fname, fop in list(self.symbols.items()):
            if not fop.regions[0].blocks:      # a declaration: no body to fold
                continue
            for op in roots_in(fop):
                n = len(self.sites)
                self._site(op, fname)
                self._end_trial(any(r.status == FOLDED for r in self.sites[n:]))
        for op in self.dead:
            op.erase()
        self.dead.clear()
        self.activation.clear()
        self.eval.memo.clear()
        for fname, fop in list(self.symbols.items()):
            if fop.regions[0].blocks and fname not in self.inlined:
                self._account_unreached(fop, fname)
        return FoldReport(self.sites)

    def _record(self, op, fname, status, info=None, **kw) -> FoldSite:
        file, line, name = location(op)
        shape = shape_of(op.results[0])
        info = info or root_info(op)
        rec = FoldSite(pattern="stablehlo_" + ("conv" if "conv" in op_name(op) else "dot") +
                       "_affine", primitive=op_name(op), status=status, scope=f"@{fname}",
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
            if info is not first and self.eval(root.operands[info[1]]) is None:
                continue                # a non-constant lhs may as well be the activations
            w = walk(HloChain(self, root, fname), root.results[0], info[0])
            k = root.operands[info[1]]
            folds = chain_kind(s.kind for s in w.steps if s.kind not in PASS_KINDS) == \
                "fold" and not (owner_op(k) is not None and self._from_root(k))
            if chosen is None or folds:
                chosen = (info, w)
            if folds:
                break
        info, w = chosen
        steps, stop, refusal = w.steps, w.stop, w.refusal
        out_axis, kidx, kaxis = info[:3]
        absorbed = [op_name(s.op).split(".")[-1] for s in steps]
        real = [s for s in steps if s.kind not in PASS_KINDS]
        status, reason = chain_status((s.kind for s in real), stop, refusal)
        if status != FOLDED:
            self._record(root, fname, info=info, status=status, reason=reason,
                         **({"absorbed": absorbed} if status == CANONICAL else {}))
            return
        kernel = root.operands[kidx]
        C_out = shape_of(root.results[0])[out_axis]
        known = self._np_chain(real, C_out)      # (kinds, float64 operands) or None
        rec = self._record(root, fname, info=info, status=FOLDED, absorbed=absorbed,
                           note=f"chain stopped: {stop}" if stop else None)
        kd = float_dtype(elem_type(kernel))
        if kd is None:
            rec.status, rec.reason = REFUSED, Reason(
                "not-float", f"the kernel is {elem_type(kernel)}, not a float")
            return
        # in-graph arithmetic: float32, or float64 when the program computes in float64
        wide = any(str(elem_type(v)) == "f64"
                   for v in (kernel, root.results[0], steps[-1].op.results[0]))
        self.ct = ir.F64Type.get() if wide else ir.F32Type.get()
        s_vec = t_vec = None
        if known:
            with np.errstate(all="ignore"):
                s_vec, t_vec = (np.broadcast_to(v, (C_out,)) for v in collapse(*known, C_out))
        k_np = self.eval(kernel) if known else None
        math = [float_dtype(elem_type(v.results[0])) for v in [root] + [st.op for st in steps]]
        dec = decide(kernel_dtype=kd, math_dtypes=[d for d in math if d is not None], s=s_vec,
            kernel=None if k_np is None else np.asarray(k_np),
            kernel_axis=kaxis, not_now=WEIGHTS_ARE_ARGUMENTS,
            in_graph=("never" if not self.in_graph else
                      "guarded" if self.guard else "unguarded"),
            kernel_from_activation=owner_op(kernel) is not None and self._from_root(kernel))
        if not dec.folds:
            rec.status, rec.reason = REFUSED, dec.reason
            return
        rec.rescale, rec.guarded = dec.rescale, dec.guard
        end_op = steps[-1].op
        end_value = end_op.results[0]
        kdt = elem_type(kernel)
        out_t = end_value.type
        with ir.Location.unknown(), ir.InsertionPoint(end_op):
            s_val, t_val = (s_vec, t_vec) if known else collapse(
                *self._ir_chain(real, C_out), C_out, xp=IrArith(C_out, self.ct))
            if dec.kernel is not None:
                new_k = stablehlo.ConstantOp(numpy_to_dense(dec.kernel, kdt)).result
            else:
                s_ir = self._const_or(s_val, C_out)
                s_b = stablehlo.BroadcastInDimOp(
                    ir.RankedTensorType.get(shape_of(kernel), self.ct), s_ir,
                    ir.DenseI64ArrayAttr.get([kaxis])).result
                k32 = self._convert(kernel, self.ct)
                new_k = self._convert(stablehlo.MulOp(k32, s_b).result, kdt)
            t_of = lambda: self._convert(self._const_or(t_val, C_out), elem_type(end_value))
            guard = dec.guard        # s is known only at run time: check it there
            if not known and not self.guard:     # the caller checks these (hlofold._split)
                new_k = self._mark_prepared(new_k)
                t_ir = self._mark_prepared(t_of())
                t_of = lambda: t_ir
            if not guard:
                new_out = self._folded_ops(root, steps, kidx, new_k, t_of, out_t, out_axis)
            else:
                t_ir = t_of()
                t_of = lambda: t_ir
                # run-time guard: a non-finite folded kernel or bias (σ² = 0 with ε = 0, an
                # inf γ) runs the site's original ops instead
                pred = stablehlo.AndOp(all_finite(new_k), all_finite(t_ir)).result
                if_op = stablehlo.IfOp([out_t], pred)
                if_op.operation.attributes[GUARD_ATTR] = ir.UnitAttr.get()
                with ir.InsertionPoint(if_op.true_branch.blocks.append()):
                    stablehlo.ReturnOp([self._folded_ops(root, steps, kidx, new_k, t_of,
                                                         out_t, out_axis)])
                with ir.InsertionPoint(if_op.false_branch.blocks.append()):
                    mapping, last = {}, None
                    for op in [root] + [st.op for st in steps]:
                        new = op.clone()
                        remap_operands(new, mapping)
                        mapping[op.results[0]] = last = new.results[0]
                    stablehlo.ReturnOp([last])
                new_out = if_op.results[0]
        end_value.replace_all_uses_with(new_out)
        self.dead.extend([s.op for s in reversed(steps)] + [root])

    def _folded_ops(self, root, steps, kidx, new_k, t_of, out_t, out_axis):
        """``root(x, new_k)``, the chain's casts replayed, plus ``broadcast(t_of())``."""
        operands = list(root.operands)
        operands[kidx] = new_k
        attrs = {n: root.attributes[n] for n in root.attributes}
        y = ir.Operation.create(op_name(root), results=[root.results[0].type],
                                operands=operands, attributes=attrs,
                                loc=root.location).results[0]
        for s in steps:        # replay the casts and shape ops of the chain on the new result
            if s.kind == "convert":
                y = self._convert(y, elem_type(s.op.results[0]))
            elif s.kind == "shape":
                new = s.op.clone()
                new.operands[0] = y
                y = new.results[0]
        t_b = stablehlo.BroadcastInDimOp(out_t, t_of(),
                                         ir.DenseI64ArrayAttr.get([steps[-1].axis])).result
        return stablehlo.AddOp(y, t_b).result

    def _mark_prepared(self, value):
        """``value`` through an op marked :data:`PREPARED_ATTR` (a folded kernel or bias
        computed in the graph, unguarded: whoever runs it checks that it is finite)."""
        op = stablehlo.ConvertOp(value.type, value)
        op.operation.attributes[PREPARED_ATTR] = ir.UnitAttr.get()
        return op.result

    def _vec(self, value, c):
        x = self.eval(value)
        return None if x is None else np.broadcast_to(np.asarray(x, np.float64).reshape(-1)
                                                      if np.size(x) > 1 else
                                                      np.asarray(x, np.float64).reshape(()),
                                                      (c,)).astype(np.float64)

    def _operand_np(self, op: Operand):
        x = self.eval(op.value)
        if x is None:
            return None
        for et in op.casts:
            x = x.astype(np_dtype(et))
        return np.asarray(x, np.float64).reshape(-1) if op.axis is not None else \
            np.asarray(x, np.float64).reshape(())

    # -- IR builders (inside an insertion point)

    def _convert(self, value, etype):
        if str(elem_type(value)) == str(etype):
            return value
        return stablehlo.ConvertOp(ir.RankedTensorType.get(shape_of(value), etype), value).result

    def _const_or(self, val, c):
        if isinstance(val, np.ndarray):
            arr = np.broadcast_to(np.asarray(val, np.float64), (c,))
            return stablehlo.ConstantOp(numpy_to_dense(arr, self.ct)).result
        return val

    def _vector_ir(self, op: Operand, c):
        """The operand as a tensor<c x f32> in the graph."""
        v = op.value
        for et in op.casts:
            v = self._convert(v, et)
        v = self._convert(v, self.ct)
        flat = stablehlo.ReshapeOp(ir.RankedTensorType.get([op.size], self.ct),
                                   v).result if shape_of(v) != (op.size,) else v
        if op.size == c:
            return flat
        return stablehlo.BroadcastInDimOp(ir.RankedTensorType.get([c], self.ct),
                                          stablehlo.ReshapeOp(ir.RankedTensorType.get(
                                              [], self.ct), flat).result,
                                          ir.DenseI64ArrayAttr.get([])).result

    def _np_chain(self, steps, c):
        """The chain as (kinds, float64 operands), ``batch_norm_inference`` spelled out as
        sub μ, mul γ/√(σ²+ε), add β; None when an operand is not known at transform time."""
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self._vec(st.bn[k], c) for k in ("scale", "offset", "mean", "variance")}
                if any(x is None for x in v.values()):
                    return None
                with np.errstate(all="ignore"):
                    sc = v["scale"] / np.sqrt(v["variance"] + st.bn["epsilon"])
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            x = None if st.operand is None else self._operand_np(st.operand)
            if st.operand is not None and x is None:
                return None
            kinds.append(st.kind)
            vals.append(x)
        return kinds, vals

    def _ir_chain(self, steps, c):
        """The same chain with operands as tensor<c x f32> values in the graph."""
        f32 = self.ct
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self._convert(st.bn[k], f32) for k in
                     ("scale", "offset", "mean", "variance")}
                eps = stablehlo.ConstantOp(numpy_to_dense(
                    np.full(c, st.bn["epsilon"], np.float64), f32)).result
                sc = stablehlo.MulOp(v["scale"], stablehlo.RsqrtOp(
                    stablehlo.AddOp(v["variance"], eps).result).result).result
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            kinds.append(st.kind)
            vals.append(None if st.operand is None else self._vector_ir(st.operand, c))
        return kinds, vals


def fold_module(module, in_graph: bool = True, guard: bool = True) -> FoldReport:
    """Fold ``module`` in place (call inside its context); returns the report.
    ``in_graph``: fold sites whose weights are arguments with the rescale in the graph,
    guarded (else refuse them with :data:`WEIGHTS_ARE_ARGUMENTS`); ``guard=False``: without
    the run-time guard, the folded kernels and biases marked :data:`PREPARED_ATTR` for the
    caller to check (see :mod:`hlofold._split`)."""
    folder = _Pass(module, in_graph, guard)
    report = folder.run()
    if report.num_folded:         # nothing folded: the module stays exactly as it was
        dce(module, folder.inlined)
    if not module.operation.verify():
        raise AssertionError("hlofold produced an invalid module")   # pragma: no cover
    return report


def fold_module_text(text_or_bytes, in_graph: bool = True) -> tuple[Any, FoldReport]:
    """Parse, fold and return ``(module, report)`` (module in hlofold's MLIR context)."""
    module = parse_module(text_or_bytes)
    with module.context, ir.Location.unknown():
        report = fold_module(module, in_graph)
    return module, report


