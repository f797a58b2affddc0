"""StableHLO branch merges decided and written (``_fold.stablehlo.merge`` reads the branches):
:func:`merge_module` finds each sum, the terms get their values, the report its record,
and the merged ``convolution + bias`` takes the sum's place."""
from __future__ import annotations

import dataclasses

import numpy as np

from hlofold import _compat as C
from hlofold._fold.core import merge as M
from hlofold._base.algebra import collapse, has_scale, has_shift
from hlofold._fold.core.patterns import conv_layout
from hlofold._base.reasons import Reason
from hlofold._base.report import MERGED, NOT_REACHED, REFUSED, FoldSite
from hlofold._fold.core.rules import round_kernel
from hlofold._ir.stablehlo.build import IrArith, broadcast, make
from hlofold._ir.stablehlo.ir import (elem_type, float_dtype, location, numpy_to_dense, op_name,
                                      owner_op, shape_of)
from .merge import (CONV, NOT_MERGED, WEIGHTS_ARGS, after_of, chain_steps, read, single, specs,
                    window)
from hlofold._ir.stablehlo.module import erase_unused
from .patterns import Evaluator, resolve
from hlofold._base.chain_rules import Refusal
from .values import HloValues

ir, stablehlo, _ = C.mlir()


_PAIR_ARGS = Reason("weights-not-known", "a sequential 1×1 → k×k pair is composed on the "
                   "host only: its weights are module arguments (give their values: "
                   "params=, --params)")


@dataclasses.dataclass
class Merged:
    x: object
    target: object
    groups: int
    kernel: np.ndarray
    shift: object
    shift_map: object
    after: object = None            # the scale of an affine after the sum it absorbed (1: None)
    end: object = None              # that affine's last op: its result is the merged one


def _affine(steps, c, vals):
    if not steps:
        return None, None
    known = vals.np_chain(steps, c)
    if known is None:
        return "unknown"
    s, t = collapse(*known, c)
    return (s if has_scale(steps) else None), (t if has_shift(steps) else None)


def merge_group(leaves, fname, ev, vals, sites, staged: bool = False, after=None):
    """Decide and record the merge of one input's branches: ``(Merged, member indices)``
    or None. ``staged``: weights that are arguments are merged in the graph, unguarded
    (``split=``: the prepare module computes the merged kernel and checks it); ``after``:
    the affine after the sum (``merge.After``), absorbed when every branch merges."""
    target = next(lf.base for lf in leaves if lf.kind in ("conv", "pair", "guarded")
                  and op_name(lf.base) == CONV)
    ls, rs, os_ = specs(target)
    axis, n = os_[1], len(ls) - 2
    shape = shape_of(target.results[0])
    c = int(shape[axis])
    structs, values = [], []
    for lf in leaves:
        s, v = _term(lf, ls, rs, os_, axis, c, n, shape, ev, vals)
        structs.append(s)
        values.append(v)
    if staged:             # a pair is composed on the host: in the graph it stays a branch
        structs = [_PAIR_ARGS if lf.kind == "pair" and v is None else st
                   for st, v, lf in zip(structs, values, leaves)]
    ok = [i for i, s in enumerate(structs) if isinstance(s, M.Term)]
    terms = [structs[i] for i in ok]
    p = M.plan(terms) if len(terms) >= 2 else next(
        s for s in structs if not isinstance(s, M.Term))
    unknown = not isinstance(p, Reason) and any(values[ok[j]] is None for j in p.members)
    if unknown and not staged:
        p = WEIGHTS_ARGS
    if isinstance(p, Reason):
        _record(target, fname, c, sites, REFUSED, reason=p, absorbed=[
            s.describe() if isinstance(s, M.Term) else M.leaf_label(lf.kind)
            for s, lf in zip(structs, leaves)])
        return None
    tw = terms[p.target].window
    tgt = terms[p.target].handle
    absorbed, note = M.describe(terms, p, [(M.leaf_label(lf.kind), st) for st, lf in zip(
        structs, leaves) if not isinstance(st, M.Term)])
    # the affine after the sum joins a merge of every branch: staged in the graph, or with
    # its values known (then ``aff``: its (s, t))
    aff, end = (None, None), None
    if after is not None and len(p.members) == len(leaves):
        got = None if unknown else _affine(after.steps, c, vals)
        if got != "unknown":
            aff, end = got or (None, None), after.ops[-1]
            absorbed = absorbed + ["·".join(st.kind for st in after.steps) + " after the sum"]
    taken = [ok[j] for j in p.members]
    if unknown:
        members = {j: leaves[ok[j]] for j in p.members}
        got = _staged(tgt, terms, p, members, axis, c, vals,
                      after if end is not None else None)
        if isinstance(got, Reason):
            _record(target, fname, c, sites, REFUSED, reason=got, absorbed=absorbed)
            return None
        _record(tgt, fname, c, sites, MERGED, note=note, absorbed=absorbed,
                rescale="in-graph", groups=tw.groups)
        return Merged(leaves[0].x, tgt, tw.groups, *got, None, end=end), taken
    s_a, t_a = aff
    full = [M.then_affine(values[i], s_a) if j in p.members else terms[j]
            for j, i in enumerate(ok)]
    k64 = M.merged_kernel(full, p, np)
    trs = specs(tgt)[1]
    kd = float_dtype(elem_type(tgt.operands[1]))
    kernel, why = round_kernel(np.transpose(k64, np.argsort(trs)), [], kd, trs[0])
    if why is not None:
        _record(target, fname, c, sites, REFUSED, reason=why, absorbed=absorbed)
        return None
    shift, smap = M.merged_shift(full, p, np)
    if t_a is not None:
        shift = t_a if shift is None else shift + t_a
    _record(tgt, fname, c, sites, MERGED, note=note, absorbed=absorbed, rescale="constant",
            groups=tw.groups)
    x = leaves[0].x
    return Merged(x, tgt, tw.groups, kernel, shift, smap, s_a, end), taken


def _staged(tgt, terms, p, members, axis, c, vals, after=None):
    """``(kernel, bias)`` of a merge computed in the graph (before the sum; inserted where
    the caller's insertion point is), each marked prepared; or why not."""
    trs = specs(tgt)[1]
    ktype = ir.RankedTensorType(tgt.operands[1].type)
    ct = ir.F64Type.get() if ktype.element_type == ir.F64Type.get() else ir.F32Type.get()
    vals.ct = ct
    arith = IrArith(c, ct)
    tw = terms[p.target].window
    if any(lf.kind == "conv" and terms[j].window.groups != tw.groups
           for j, lf in members.items()):
        return Reason("branches", "groups differ, and the weights are module arguments: "
                      "merged with their values only (params=, --params)")
    total, shift = None, None
    for j, lf in members.items():
        t, off = terms[j], p.members[j]
        if lf.kind == "conv":
            ms = specs(lf.base)[1]
            k = vals.convert(lf.base.operands[1], ct)
            if tuple(ms) != tuple(trs):      # the member's layout read as the target's
                perm = [ms[list(trs).index(a)] for a in range(len(trs))]
                k = stablehlo.TransposeOp(k, ir.DenseI64ArrayAttr.get(perm)).result
        else:
            canon = M.expand_groups(np.ones((c, 1) + t.window.size), t.window.groups,
                                    tw.groups)
            k = stablehlo.ConstantOp(numpy_to_dense(np.ascontiguousarray(
                np.transpose(canon, np.argsort(trs))), ct)).result
        steps = chain_steps(lf.chain, axis) or []
        sc, sh = (None, None) if not steps else collapse(*vals.ir_chain(steps, c), c, xp=arith)
        if has_scale(steps):
            k = stablehlo.MulOp(k, broadcast(k.type, arith.value(sc), [trs[0]])).result
        if has_shift(steps):
            shift = sh if shift is None else arith.add(shift, sh)
        lo = [0] * len(trs)
        hi = [0] * len(trs)
        for d, (o, size, big) in enumerate(zip(off, t.window.size, tw.size)):
            lo[trs[2 + d]], hi[trs[2 + d]] = o, big - size - o
        if any(lo) or any(hi):
            shape = list(shape_of(k))
            for a in range(len(shape)):
                shape[a] += lo[a] + hi[a]
            zero = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                ir.RankedTensorType.get([], ct), ir.FloatAttr.get(ct, 0.0))).result
            k = make("stablehlo.pad", [ir.RankedTensorType.get(shape, ct)], [k, zero],
                     {"edge_padding_low": ir.DenseI64ArrayAttr.get(lo),
                      "edge_padding_high": ir.DenseI64ArrayAttr.get(hi),
                      "interior_padding": ir.DenseI64ArrayAttr.get([0] * len(lo))}).result
        total = k if total is None else stablehlo.AddOp(total, k).result
    if after is not None:          # the affine after the sum: kernel·s, (bias + b)·s + t
        for _, r in after.biases:
            b = vals.vector_ir(r, c)
            shift = b if shift is None else arith.add(shift, b)
        sc, sh = collapse(*vals.ir_chain(after.steps, c), c, xp=arith)
        if has_scale(after.steps):
            total = stablehlo.MulOp(total, broadcast(total.type, arith.value(sc),
                                                     [trs[0]])).result
            shift = None if shift is None else arith.mul(shift, sc)
        if has_shift(after.steps):
            shift = sh if shift is None else arith.add(shift, sh)
    kernel = vals.mark_prepared(vals.convert(total, ktype.element_type))
    bias = None if shift is None else vals.mark_prepared(arith.value(shift))
    return kernel, bias


def _term(lf, ls, rs, os_, axis, c, n, shape, ev, vals):
    """``(structure, term with values or None when a weight is not known)``."""
    if lf.kind in NOT_MERGED:
        return NOT_MERGED[lf.kind], None
    steps = chain_steps(lf.chain, axis)
    if steps is None:
        return Reason("branches", "a branch's arithmetic is not per output channel"), None
    if lf.kind in ("identity", "pool") and tuple(ls) != tuple(os_):
        return Reason("branches", "the convolution's input and output layouts differ, so "
                      "an identity or pool branch has no kernel in it"), None
    if lf.kind == "identity":
        if shape_of(lf.x) != shape:
            return Reason("branches", "a value of another shape"), None
        w = M.depthwise_window(c, (1,) * n, (1,) * n, ((0, 0),) * n)
        kernel = M.identity_kernel(c, n)
    else:
        w = window(lf.base, ls)
        if w is None or (op_name(lf.base) == CONV and tuple(specs(lf.base)[2]) != tuple(os_)):
            return Reason("branches", f"a branch's {op_name(lf.base)} has another layout"), None
        kernel = (_kernel(lf.base, ev) if op_name(lf.base) == CONV
                  else np.ones((w.out_channels, 1) + w.size))
    handle = lf.base if lf.kind in ("conv", "pair") and op_name(lf.base) == CONV else None
    aff = _affine(steps, c, vals)
    if lf.kind == "pair":
        w1 = window(lf.first.base, ls)
        steps1 = chain_steps(lf.first.chain, specs(lf.first.base)[2][1])
        if w1 is None or steps1 is None:
            return Reason("branches", "the first convolution of a pair has another layout "
                          "or arithmetic that is not per channel"), None
        s = M.pair_structure(w1, w, lf.base, handle is not None)
        if isinstance(s, Reason):
            return s, None
        m = int(shape_of(lf.first.base.results[0])[specs(lf.first.base)[2][1]])
        aff1 = _affine(steps1, m, vals)
        k1 = _kernel(lf.first.base, ev)
        if "unknown" in (aff, aff1) or kernel is None or k1 is None:
            return s, None
        first = M.Term("conv", w1, k1, *aff1)
        second = M.Term("conv" if handle is not None else "pool", w, kernel, *aff,
                        handle=handle)
        sp = [int(shape_of(lf.base.operands[0])[d]) for d in ls[2:]]
        t = M.compose(first, second, sp, [int(shape[d]) for d in os_[2:]])
        return (t if isinstance(t, Reason) else s), (t if isinstance(t, M.Term) else None)
    s = M.Term(lf.kind, w, None, handle=handle)
    if aff == "unknown" or kernel is None:
        return s, None
    return s, M.Term(lf.kind, w, kernel, *aff, handle=handle)


def _kernel(op, ev):
    """A conv's kernel (canonical, float64); None: not known."""
    k = ev(op.operands[1])
    return None if k is None else np.transpose(np.asarray(k, np.float64), specs(op)[1])


def _drop_unreached(sites, taken: dict) -> None:
    """Drop the not-reached records of the norms merges took (``taken``: function name ->
    their locations), once per module."""
    if any(taken.values()):
        sites[:] = [s for s in sites if not (
            s.status == NOT_REACHED and s.scope.startswith("@") and
            (s.file, s.line, s.name_stack) in taken.get(s.scope[1:], ()))]


def _record(op, fname, c, sites, status, groups=None, **kw) -> None:
    file, line, name = location(op)
    ls, rs, os_ = specs(op)
    sites.append(FoldSite(
        pattern="branches", primitive=op_name(op), status=status, scope=f"@{fname}",
        file=file, line=line, name_stack=name, layout=conv_layout(ls, rs, os_),
        in_channels=int(shape_of(op.operands[0])[ls[1]]), out_channels=c,
        groups=groups or (ir.IntegerAttr(op.attributes["feature_group_count"]).value
                          if "feature_group_count" in op.attributes else 1),
        dtype=str(elem_type(op.results[0])), **kw))


def rewrite(top, merges: list[Merged], rest: list):
    """``top``'s result computed as the merged convolutions plus ``rest`` (or the result of
    the affine after it they absorbed); returns the op now unused (erased by the caller,
    once its function is done: the ops after it are still to be visited)."""
    rtype = top.results[0].type
    with ir.InsertionPoint(next((m.end for m in merges if m.end is not None), top)):
        y = None
        for m in merges:
            ktype = ir.RankedTensorType(m.target.operands[1].type)
            k = m.kernel if not isinstance(m.kernel, np.ndarray) else stablehlo.ConstantOp(
                numpy_to_dense(m.kernel, ktype.element_type)).result
            named = m.target.attributes
            attrs = {named[i].name: named[i].attr for i in range(len(named))}
            gtype = (ir.IntegerAttr(attrs["feature_group_count"]).type
                     if "feature_group_count" in attrs else ir.IntegerType.get_signless(64))
            attrs["feature_group_count"] = ir.IntegerAttr.get(gtype, m.groups)
            z = make(CONV, [m.target.results[0].type], [m.x, k], attrs).result
            et = elem_type(z)
            os_ = specs(m.target)[2]
            if m.shift is not None:
                if isinstance(m.shift, (np.ndarray, np.generic, float, int)):
                    vec = np.broadcast_to(np.asarray(m.shift, np.float64),
                                          (shape_of(z)[os_[1]],))
                    b = stablehlo.ConstantOp(numpy_to_dense(np.ascontiguousarray(vec),
                                                            et)).result
                else:
                    b = m.shift if elem_type(m.shift) == et else stablehlo.ConvertOp(
                        ir.RankedTensorType.get(shape_of(m.shift), et), m.shift).result
                z = stablehlo.AddOp(z, broadcast(z.type, b, [os_[1]])).result
            if m.shift_map is not None:
                mp = np.moveaxis(m.shift_map[None], list(range(m.shift_map.ndim + 1)),
                                 [os_[0], os_[1]] + list(os_[2:]))
                b = stablehlo.ConstantOp(numpy_to_dense(np.ascontiguousarray(mp), et)).result
                z = stablehlo.AddOp(z, broadcast(z.type, b, list(range(mp.ndim)))).result
            y = z if y is None else stablehlo.AddOp(y, z).result
        for a in rest:
            y = stablehlo.AddOp(y, a).result
    if y.type != rtype:         # pragma: no cover (the leaves have the sum's type)
        raise AssertionError("merged sum of another type")
    end = next((m.end for m in merges if m.end is not None), top)
    end.results[0].replace_all_uses_with(y)
    return end


class _Values(HloValues):
    def __init__(self, ev):
        self.eval = ev
        self.ct = ir.F32Type.get()


def merge_module(module, fname_ops, sites: list, staged: bool = False,
                 bound: dict | None = None) -> None:
    """Merge the branch sums of each function (``fname_ops``: name → func op) of
    ``module`` in place, recording each merge or refusal in ``sites``; ``staged``: merge
    argument weights in the graph, unguarded (``split=``)."""
    ev = Evaluator(module, bound)
    vals = _Values(ev)
    taken: dict = {}
    for fname, fop in fname_ops.items():
        if not fop.regions[0].blocks:
            continue
        n = len(sites)
        dead: list = []
        for op in list(fop.regions[0].blocks[0].operations):
            if op_name(op) == "stablehlo.add" and _is_top(op) and \
                    next(iter(op.results[0].uses), None) is not None:   # (not dead)
                _merge_tree(op, fname, ev, vals, sites, staged, taken.setdefault(fname, set()),
                            dead)
        erase_unused(dead)
        runs = len(ev.calls.get(fname, ())) if fname != "main" and len(sites) > n else 1
        for r in sites[n:]:      # a function called per layer: once per call (as the pass)
            if runs > 1 and not r.layers:
                r.layers = runs
    _drop_unreached(sites, taken)


def _is_top(op) -> bool:
    u = list(op.results[0].uses)
    return not (len(u) == 1 and op_name(u[0].owner) == "stablehlo.add")


def _tree_leaves(op) -> list:
    out = []
    for v in op.operands:
        p = owner_op(v)
        if p is not None and op_name(p) == "stablehlo.add" and single(v):
            out.extend(_tree_leaves(p))
        else:
            out.append(v)
    return out


def _merge_tree(top, fname, ev, vals, sites, staged, unreached: set, dead: list) -> None:
    shape = shape_of(top.results[0])
    atoms = _tree_leaves(top)
    leaves = [read(a, ev) if shape_of(a) == shape else None for a in atoms]
    groups = M.group_leaves(leaves, single)
    done = []
    after = after_of(top, atoms, groups, leaves, vals, staged)
    for ks in groups:
        # (a staged merge's ops go before the sum, or before the last op of its affine)
        with ir.InsertionPoint(after.ops[-1] if after else top):
            res = merge_group([leaves[k] for k in ks], fname, ev, vals, sites, staged, after)
        if res is not None:
            done.append((res[0], [ks[j] for j in res[1]]))
            unreached.update(location(op) for k in done[-1][1]
                             for part in (leaves[k], leaves[k].first) if part is not None
                             for op, _ in part.chain)
            if res[0].end is not None:
                unreached.update(location(op) for op in after.ops)
    if done:
        taken = {k for _, ks in done for k in ks}
        m = done[0][0]                    # the sum's known per-channel biases join its bias
        if m.end is not None and staged:  # (staged, with the affine after: joined already)
            taken.update(k for k, _ in after.biases)
        axis = specs(m.target)[2][1]
        for k, a in enumerate(atoms):
            r = None if k in taken else resolve(a, shape, axis, explain=False)
            val = None if r is None or isinstance(r, Refusal) else vals.operand_np(r)
            if val is not None:
                val = val if m.after is None else val * m.after
                m.shift = val if m.shift is None else m.shift + val
                taken.add(k)
        dead.append(rewrite(top, [m for m, _ in done],
                            [a for k, a in enumerate(atoms) if k not in taken]))
