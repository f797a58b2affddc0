"""Writing a folded StableHLO site: the emission half of the pass (``_fold.stablehlo.fold``).

A decided site's ops are replaced by ``root(x, K')`` (with a bias map where a padded
convolution needs one), the chain's casts and shape ops replayed, and ``+ t``. Where the
rescale runs in the graph it is guarded: a ``stablehlo.if`` (marked ``GUARD``) runs the
original ops when the folded kernel or bias is not finite. A forward fold's per-token
factors (``x·r``) are written once per normalized value, before its first root.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._base.algebra import collapse, has_shift
from hlofold._base.chain_rules import channel_count
from hlofold._ir.stablehlo.build import (GUARD, IrArith, all_finite, broadcast_channels, is_host,
                                         make, marker)
from hlofold._ir.stablehlo.ir import (elem_type, numpy_to_dense, op_name, owner_op, remap_operands,
                                      shape_of)
from .patterns import root_shapes

ir, stablehlo, func_dialect = C.mlir()


class SiteWriter:
    """Reads the pass's state (``ct``, ``guard``, ``guard_parts``, ``written``, ``claimed``,
    ``replaced``, ``dead``, ``token_inputs``) and its value helpers (``_fold.stablehlo.values``)."""

    def _rewrite(self, root, steps, real, info, fwd, dec, known, s_vec, t_vec, bmap, add_t):
        """Replace the site's ops: ``root(x, K')`` (+ bias map), the chain's casts and shape
        ops, ``+ t``; in the graph, guarded: an ``if`` that runs the original ops when the
        folded kernel or bias is not finite."""
        out_axis, kidx, kaxis = info.channel_axis, info.kernel_index, info.kernel_axis
        kernel = root.operands[kidx]
        C_out = channel_count(root_shapes(root)[2], out_axis)
        end_op = steps[-1].op if steps else root
        end_value = end_op.results[0]
        kdt = elem_type(kernel)
        out_t = end_value.type
        # first, before anything this site writes: x·r, before the root
        x = None if fwd is None else self._token_input(fwd, root)
        with ir.Location.unknown(), ir.InsertionPoint(end_op):
            s_val, t_val = (s_vec, t_vec) if known else collapse(
                *self.ir_chain(real, C_out), C_out, xp=IrArith(C_out, self.ct))
            if known and not known[0]:
                s_val = 1.0        # nothing after the root: s is ones (no array to look at)
            if dec.kernel is not None:
                new_k = stablehlo.ConstantOp(numpy_to_dense(dec.kernel, kdt)).result
            else:
                if fwd is None:
                    kc = self.convert(kernel, self.ct)
                else:            # (before the root: it reads what the chain in front reads)
                    with ir.InsertionPoint(root):
                        kc, b = self.forward_kernel_ir(self.convert(kernel, self.ct), fwd, info,
                                                       C_out)
                    if b is not None:     # the bias the input shift adds, through the chain
                        xp = IrArith(C_out, self.ct)
                        t_val = xp.add(xp.mul(xp.asarray(s_val), b), xp.asarray(t_val))
                if not _ones(s_val):                                        # (K·1 is K)
                    s_ir = self.const_or(s_val, C_out)
                    s_b = broadcast_channels(ir.RankedTensorType.get(shape_of(kernel), self.ct),
                                             s_ir, kaxis)
                    kc = make("stablehlo.multiply", [kc.type], [kc, s_b]).result
                new_k = self.convert(kc, kdt)
            # no shift absorbed: t is exactly 0, and no add is written (as on a jaxpr); a
            # bias known now is checked now (a finite one needs no run-time check)
            add_t = add_t and (has_shift(real) or
                               (fwd is not None and fwd.has_shift))
            t_of = lambda: self.convert(self.const_or(t_val, C_out), elem_type(end_value))
            guard = dec.guard        # s is known only at run time: check it there
            if not known or (fwd is not None and fwd.s_known is None):
                if not self.guard:     # the caller checks these (hlofold._fold.stablehlo.split)
                    new_k = self.mark_prepared(new_k)
                    if add_t:
                        t_ir = self.mark_prepared(t_of())
                        t_of = lambda: t_ir
            fold = dict(root=root, steps=steps, info=info, fwd=fwd, x=x, new_k=new_k,
                        out_t=out_t, bmap=bmap, add_t=add_t)
            if not guard:
                new_out = self._folded_ops(t_of=t_of, **fold)
            else:
                t_ir = t_of() if add_t else None
                t_of = lambda: t_ir
                # run-time guard: a non-finite folded kernel or bias (σ² = 0 with ε = 0, an
                # inf γ) runs the site's original ops instead
                pred = all_finite(new_k, self.guard_parts)
                if add_t and not (is_host(t_val) and bool(np.all(np.isfinite(t_val)))):
                    pred = stablehlo.AndOp(pred, all_finite(t_ir, self.guard_parts)).result
                attrs = self.guard_parts.get(GUARD)
                if attrs is None:
                    attrs = self.guard_parts[GUARD] = marker(GUARD)
                if_op = make("stablehlo.if", [out_t], [pred], attrs, regions=2)
                folded, original = if_op.regions
                with ir.InsertionPoint(folded.blocks.append()):
                    make("stablehlo.return", [], [self._folded_ops(t_of=t_of, **fold)])
                with ir.InsertionPoint(original.blocks.append()):
                    mapping, last = {}, None
                    for op in [root] + [st.op for st in steps]:
                        new = op.clone()
                        if mapping:
                            remap_operands(new, mapping)
                        mapping[op.results[0]] = last = new.results[0]
                    make("stablehlo.return", [], [last])
                new_out = if_op.results[0]
        end_value.replace_all_uses_with(new_out)
        # the rules of later sites read the program as written (the jaxpr path plans on the
        # original equations): the op now producing the site's value stands for its old one
        new_op = owner_op(new_out)
        self.replaced[new_op] = op_name(end_op)
        # ... also for the walks' memos: computed from a root, from the same inputs (the
        # fold recombines what the site's ops read), so no later query walks into the guard
        self.lineage[new_out] = self._lineage(end_value) | 1
        self.dead.extend([s.op for s in reversed(steps)] + [root])

    def _folded_ops(self, root, steps, info, fwd, x, new_k, t_of, out_t, bmap, add_t):
        """``root(x, new_k)`` (``x``: before the forward chain, times its per-token factors;
        None: the root's own input), plus the bias map, the chain's casts and shape ops
        replayed, plus ``broadcast(t_of())``; the final op is claimed (a later root's forward
        chain does not take it)."""
        new_root = root.clone()           # (its attributes and location, as one call)
        new_root.operands[info.kernel_index] = new_k
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
            axis = steps[-1].axis if steps else info.channel_axis
            t_b = broadcast_channels(out_t, t_of(), axis)
            y = stablehlo.AddOp(y, t_b).result
        if owner_op(y) is not None:
            self.claimed.add(owner_op(y).operation)
        return y

    def _token_input(self, fwd, root):
        """The root's new input: the chain's source through its per-token ops (``x·r``),
        written once per source and kept factors, just before the first root reading it
        (later roots reading the same normalized value, Q/K/V, sit after it in the same
        block and read the same op)."""
        if not fwd.tokens and not fwd.passes:
            return fwd.source
        key = (fwd.source, *(w for _, w in fwd.tokens), *(k for k, _ in fwd.tokens),
               *(op.operation for op in fwd.passes))
        x = self.token_inputs.get(key)
        if x is not None:
            return x
        if len(fwd.tokens) == 1 and fwd.tokens[0][0] == "mul":
            # the program's own x·r, a chain op before the root: read, not written again
            w = fwd.tokens[0][1]
            x = next((op.results[0] for op in fwd.taken
                      if op_name(op) == "stablehlo.multiply" and
                      list(op.operands) in ([fwd.source, w], [w, fwd.source])), None)
        with ir.Location.unknown(), ir.InsertionPoint(root):
            if x is None:
                x = fwd.source
                for kind, w in fwd.tokens:    # per-token ops stay: the root reads x·r
                    x = (stablehlo.MulOp if kind == "mul" else stablehlo.AddOp)(x, w).result
                    self.written.add(owner_op(x).operation)
            for op in fwd.passes:             # (its sharding constraints, as written)
                new = op.operation.clone()
                new.operands[0] = x
                x = new.results[0]
                self.written.add(new)
        self.token_inputs[key] = x
        return x


def _ones(x) -> bool:
    """Whether ``x`` is a host value of ones (a Python 1.0: no array made)."""
    if isinstance(x, float):
        return x == 1.0
    return is_host(x) and bool((np.asarray(x) == 1).all())
