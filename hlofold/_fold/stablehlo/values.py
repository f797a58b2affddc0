"""Values of a StableHLO site: chain operands on the host (float64) or as graph values.

:class:`HloValues` is the value half of the StableHLO pass (``_fold.stablehlo.fold._Pass``): the chain
after a root (and the one in front of it) as ``(kinds, operands)`` for ``_base.algebra.collapse``,
with the operands known now (float64 NumPy, ``batch_norm_inference`` spelled out) or as
``tensor<c x f32|f64>`` values in the graph; the in-graph kernel arithmetic of a forward
fold (``K ⊙_in s`` and ``Σ K·t``); and small IR builders. Used inside an insertion point.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._base.algebra import collapse, per_channel
from hlofold._base.chain_rules import block_values, channel_count, on_axis
from hlofold._fold.core.rules import flushes_differently
from hlofold._ir.stablehlo.build import PREPARED, IrArith, broadcast, make, mark
from hlofold._ir.stablehlo.ir import elem_type, np_dtype, numpy_to_dense, shape_of
from .patterns import Operand

ir, stablehlo, func_dialect = C.mlir()


class HloValues:
    """Site values for the StableHLO pass (reads ``self.eval`` and ``self.ct``; shares what
    roots of one forward chain write through ``self.shared_by_chain``)."""

    def mark_prepared(self, value):
        """``value`` through an op marked ``PREPARED`` (a folded kernel or bias
        computed in the graph, unguarded: whoever runs it checks that it is finite)."""
        op = stablehlo.ConvertOp(value.type, value)
        mark(op, PREPARED)
        return op.result

    def vec_np(self, value, c):
        x = self.eval(value)
        return None if x is None else per_channel(np.reshape(x, -1) if np.size(x) > 1 else
                                                  np.reshape(x, ()), c)

    def operand_np(self, op: Operand):
        x = self.eval(op.value)
        if x is None:
            return None
        for et in op.casts:
            x = x.astype(np_dtype(et))
        return block_values(op, np.asarray(x, np.float64).reshape(-1)) if op.axis is not None \
            else np.asarray(x, np.float64).reshape(())

    def flushes(self, values, steps) -> bool:
        """Whether the host value of one of ``values`` or of the steps' operands (a
        ``batch_norm_inference``'s too) depends on subnormals a backend flushes."""
        vals = list(values) + [st.operand.value for st in steps if st.operand is not None]
        vals += [v for st in steps if st.bn for v in st.bn.values() if not isinstance(v, float)]
        return any(v in self.eval.flushed for v in vals)

    # -- IR builders (inside an insertion point)

    def convert(self, value, etype):
        if elem_type(value) == etype:
            return value
        return stablehlo.ConvertOp(ir.RankedTensorType.get(shape_of(value), etype), value).result

    def const_or(self, val, c):
        """``val`` in the graph: a tensor<c x f32|f64> constant for a host value."""
        return IrArith(c, self.ct).value(val)

    def vector_ir(self, op: Operand, c):
        """The operand as a tensor<c x f32> in the graph."""
        v = op.value
        for et in op.casts:
            v = self.convert(v, et)
        v = self.convert(v, self.ct)
        if op.block is not None and tuple(op.block) != tuple(op.block_dims):   # broadcast
            v = broadcast(ir.RankedTensorType.get(list(op.block_dims), self.ct), stablehlo.
                          ReshapeOp(ir.RankedTensorType.get(list(op.block), self.ct), v).result,
                          list(range(len(op.block))))
        flat = stablehlo.ReshapeOp(ir.RankedTensorType.get([op.size], self.ct),
                                   v).result if shape_of(v) != (op.size,) else v
        if op.size == c:
            return flat
        return stablehlo.BroadcastInDimOp(ir.RankedTensorType.get([c], self.ct),
                                          stablehlo.ReshapeOp(ir.RankedTensorType.get(
                                              [], self.ct), flat).result,
                                          ir.DenseI64ArrayAttr.get([])).result

    def np_chain(self, steps, c):
        """The chain as (kinds, float64 operands), ``batch_norm_inference`` spelled out as
        sub μ, mul γ/√(σ²+ε), add β; None when an operand is not known at transform time."""
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self.vec_np(st.bn[k], c) for k in ("scale", "offset", "mean", "variance")}
                if any(x is None for x in v.values()):
                    return None
                var, eps = self.eval(st.bn["variance"]), st.bn["epsilon"]
                root = lambda a: np.sqrt(a.astype(np.float64) + eps).astype(a.dtype)  # noqa
                with np.errstate(all="ignore"):
                    if flushes_differently(root, [var], root(var)):
                        self.eval.flushed.add(st.bn["variance"])  # as XLA expands it
                        return None
                    sc = v["scale"] / np.sqrt(v["variance"] + st.bn["epsilon"])
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            x = None if st.operand is None else self.operand_np(st.operand)
            if st.operand is not None and x is None:
                return None
            kinds.append(st.kind)
            vals.append(x)
        return kinds, vals

    def ir_chain(self, steps, c):
        """The same chain with operands as tensor<c x f32> values in the graph."""
        f32 = self.ct
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self.convert(st.bn[k], f32) for k in
                     ("scale", "offset", "mean", "variance")}
                eps = stablehlo.ConstantOp(numpy_to_dense(
                    np.full(c, st.bn["epsilon"], np.float64), f32)).result
                sc = stablehlo.MulOp(v["scale"], stablehlo.RsqrtOp(
                    stablehlo.AddOp(v["variance"], eps).result).result).result
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            kinds.append(st.kind)
            vals.append(None if st.operand is None else self.vector_ir(st.operand, c))
        return kinds, vals

    def forward_kernel_ir(self, kc, fwd, info, c_out: int):
        """In the graph: ``(kc ⊙_in s, Σ kc·t)`` for the forward fold ``fwd`` (``kc``: the
        kernel in the arithmetic type; the bias is None without a shift). Insert before the
        root: ``s`` and ``t`` over the kernel are written once for the roots that share the
        chain in one block with kernels of one type (Q, K, V read one broadcast of γ; later
        roots of a block sit after the first)."""
        c_in, ko, ki = info.in_channels, info.kernel_axis, fwd.k_in_axis
        ktype = ir.RankedTensorType.get(shape_of(kc), self.ct)
        shared = self.shared_by_chain(fwd.steps)
        key = ("on kernel", ir.InsertionPoint.current.block, ktype, ko, ki, fwd.groups, c_out)
        if key not in shared:
            if fwd.s_known is not None:
                s_in, t_in = fwd.s_known, fwd.t_known
            else:
                s_in, t_in = collapse(*self.ir_chain(fwd.steps, c_in), c_in,
                                      xp=IrArith(c_in, self.ct))
            on = (lambda v: self._on_kernel(v, c_in, fwd.groups, c_out, ktype, ko, ki))
            shared[key] = (on(s_in), on(t_in) if fwd.has_shift else None)
        s_k, t_k = shared[key]
        b = None
        if t_k is not None:
            w = make("stablehlo.multiply", [kc.type], [kc, t_k]).result
            b = _reduce_sum_but(w, ko, self.ct)
        kc = make("stablehlo.multiply", [kc.type], [kc, s_k]).result
        return kc, b

    def _on_kernel(self, vec, c_in: int, g: int, c_out: int, ktype, ko: int, ki: int):
        """A per-input-channel vector (length C_in) broadcast over the kernel: output channel
        o reads the inputs of its group (``_base.algebra.group_matrix_np``)."""
        ipg = c_in // g
        vec = self.const_or(vec, c_in)
        if g == 1:
            return broadcast(ktype, vec, [ki])
        m = stablehlo.ReshapeOp(ir.RankedTensorType.get([g, ipg], self.ct), vec).result
        m = stablehlo.BroadcastInDimOp(ir.RankedTensorType.get([g, c_out // g, ipg], self.ct),
                                       m, ir.DenseI64ArrayAttr.get([0, 2])).result
        m = stablehlo.ReshapeOp(ir.RankedTensorType.get([c_out, ipg], self.ct), m).result
        dims = [ko, ki]
        if ko > ki:                     # broadcast dimensions in increasing order
            m = stablehlo.TransposeOp(m, ir.DenseI64ArrayAttr.get([1, 0])).result
            dims = [ki, ko]
        return stablehlo.BroadcastInDimOp(ktype, m, ir.DenseI64ArrayAttr.get(dims)).result


def _reduce_sum_but(x, axis: int, ct):
    """``x`` summed over every axis but ``axis`` (a ``stablehlo.reduce`` with an add body)."""
    shape = shape_of(x)
    scalar = ir.RankedTensorType.get([], ct)
    init = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
        scalar, ir.FloatAttr.get(ct, 0.0))).result
    kept = [d for a, d in enumerate(shape) if on_axis(a, axis)]
    red = stablehlo.ReduceOp([ir.RankedTensorType.get(kept, ct)], [x], [init],
                             ir.DenseI64ArrayAttr.get([a for a in range(len(shape))
                                                       if not on_axis(a, axis)]))
    body = red.body.blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        stablehlo.ReturnOp([stablehlo.AddOp(body.arguments[0], body.arguments[1]).result])
    if len(kept) == 1:
        return red.results[0]
    return stablehlo.ReshapeOp(ir.RankedTensorType.get([channel_count(shape, axis)], ct),
                               red.results[0]).result    # a Block's: flattened
