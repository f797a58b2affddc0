"""Parallel branches merged on a jaxpr: the rule of ``_fold.core.merge`` read from equations.

After a scope's BatchNorms are folded, a RepVGG-style block is a sum (a tree of ``add``
equations) whose leaves are branches reading one input ``x``: ``conv(x, K)`` with the affine
left after it (``+ t`` of a folded site, or a BatchNorm no root took: the identity branch's),
an average pool (``reduce_window_sum`` then ``/ n``), a 1×1 → k×k pair, ``x`` itself, and
per-channel biases. :func:`merge_scope` reads each tree into ``_fold.core.merge.Term`` s, asks the
core which merge (:func:`hlofold._fold.core.merge.plan`), and writes the merged
``conv(x, Σ embed(Kᵢ·sᵢ)) + Σ t`` in place of the tree's last ``add`` (the branches' equations
are then dead, and the scope drops them). Known weights are merged in float64 on the host and
rounded once; weights that are inputs are merged in the graph where the caller prepares them
(``in_graph="prepared"``/``"unguarded"``), else the merge is refused as ``weights-not-known``
(which makes :func:`hlofold.fold` prepare them).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._fold.core import merge as M
from hlofold._base.algebra import collapse, has_scale, has_shift, np64
from hlofold._base.chain_rules import Refusal
from hlofold._base.reasons import Reason
from .merge_emit import drop_unreached, merge_group, splice, unreached_keys
from .emit import is_guard
from .steps import AFFINE_STEPS, AffineStep, affine_step, resolve_operand

_CONV, _POOL = "conv_general_dilated", "reduce_window_sum"
# elementwise nonlinearities a branch may end in (refused with that reason; other ops end
# the reading: the leaf is no branch)
NONLINEAR = ops.names(lambda o: o.activation)


def _producer(view, v):
    return view.producer.get(v, (0, None))[1] if isinstance(v, C.Var) else None


def _single(view, v) -> bool:
    return isinstance(v, C.Var) and len(view.uses.get(v, ())) == 1 and not view.out_uses.get(v)


def _operand(view, a, shape, axis):
    r = resolve_operand(a, shape, axis, lambda v: _producer(view, v))
    return None if isinstance(r, Refusal) else r


def _param_like(view, a, shape) -> bool:
    return isinstance(a, C.Literal) or not a.aval.shape or any(
        _operand(view, a, shape, ax) is not None for ax in range(len(shape)) if shape[ax] != 1)


def _walk_back(view, v):
    """From ``v`` back through affine equations whose values are read once."""
    chain = []
    while (e := _producer(view, v)) is not None and e.primitive.name in AFFINE_STEPS:
        shape = tuple(e.outvars[0].aval.shape)
        if e.primitive.name == "neg":
            pos = 0
        else:
            p = [_param_like(view, a, shape) for a in e.invars]
            if len(p) != 2 or p.count(False) != 1:
                break
            pos = p.index(False)
        if tuple(e.invars[pos].aval.shape) != shape:
            break
        chain.append((e, pos))
        v = e.invars[pos]
        if not _single(view, v):
            break
    return v, chain


@dataclasses.dataclass
class After:
    """A per-channel affine after a whole sum (a BatchNorm of the block's output): its
    steps, and the variable the last one defines (the merged convolution's result then)."""

    steps: list
    out: C.Var
    last: int                   # the index of the last step's equation
    channels: int

    def needs(self) -> list:
        return [st.operand.source for st in self.steps if st.operand is not None]

    def affine(self, get, xp):
        return _affine(self.steps, [None if st.operand is None else get(st.operand)
                                    for st in self.steps], self.channels, xp)


def _walk_forward(view, v, axis, channels) -> After | None:
    """From ``v`` forward through affine equations per channel along ``axis`` that read it
    alone (each value read once), as far as they go; None: not one."""
    steps, last = [], None
    shape = tuple(v.aval.shape)
    prod = lambda a: _producer(view, a)
    while _single(view, v):
        i, pos = view.uses[v][0]
        e = view.jaxpr.eqns[i]
        if e.primitive.name not in AFFINE_STEPS or tuple(e.outvars[0].aval.shape) != shape \
                or e.outvars[0].aval.dtype != v.aval.dtype or \
                (e.primitive.name != "neg" and (len(e.invars) != 2 or e.invars[1 - pos] is v
                                                or not _param_like(view, e.invars[1 - pos],
                                                                   shape))):
            break
        st = affine_step(e, pos, axis, prod)
        if not isinstance(st, AffineStep):
            break
        steps.append(st)
        v, last = e.outvars[0], i
    return After(steps, v, last, channels) if steps else None


def _read(view, leaf) -> M.Leaf:
    base_v, chain = _walk_back(view, leaf)
    e = _producer(view, base_v)
    name = e.primitive.name if e is not None else None
    if name in (_CONV, _POOL) and not (name == _CONV and view.from_root(e.invars[1])):
        if not _single(view, base_v):
            return M.Leaf("shared", e.invars[0], leaf, e, chain)
        t = M.Leaf("conv" if name == _CONV else "pool", e.invars[0], leaf, e, chain)
        mid, chain1 = _walk_back(view, e.invars[0])
        e1 = _producer(view, mid)
        if e1 is not None and e1.primitive.name == _CONV and _single(view, mid) and \
                _single(view, e.invars[0]) and not view.from_root(e1.invars[1]):
            t.first = M.Leaf("conv", e1.invars[0], e.invars[0], e1, chain1)
        return t
    inner = _inner_conv(view, e) if e is not None else None
    if inner is not None and inner[0] == "guarded":
        return M.Leaf(inner[0], inner[1], leaf, inner[2], chain)
    return M.Leaf("identity", base_v, leaf, None, chain,
                 alt=inner[1:] if inner is not None else None)


def _inner_conv(view, e):
    """``(kind, x, op)`` where ``e`` hides a branch convolution on ``x``: a folded site's
    run-time guard ("guarded"), or an elementwise op of one activation on a conv's output
    ("nonlinear")."""
    if is_guard(e):
        branch = C.cond_branches(e)[1].jaxpr
        conv = next((q for q in branch.eqns if q.primitive.name == _CONV), None)
        if conv is not None and conv.invars[0] in branch.invars:
            return "guarded", e.invars[1 + branch.invars.index(conv.invars[0])], conv
        return None
    if e.primitive.name not in NONLINEAR:
        return None
    shape = tuple(e.outvars[0].aval.shape)
    acts = [a for a in e.invars if isinstance(a, C.Var) and tuple(a.aval.shape) == shape
            and not _param_like(view, a, shape)]
    if len(e.outvars) != 1 or len(acts) != 1:
        return None
    v, _ = _walk_back(view, acts[0])
    conv = _producer(view, v)
    if conv is not None and conv.primitive.name == _CONV:
        return "nonlinear", conv.invars[0], e
    return None


def _window(e, lhs_spec) -> M.Window | None:
    """The core's Window of a conv or pool equation (None: another layout)."""
    p = e.params
    if e.primitive.name == _CONV:
        dn = p["dimension_numbers"]
        if tuple(dn.lhs_spec) != tuple(lhs_spec):
            return None
        rhs, lhs = e.invars[1].aval.shape, e.invars[0].aval.shape
        return M.Window(tuple(rhs[d] for d in dn.rhs_spec[2:]), tuple(p["window_strides"]),
                        tuple(tuple(q) for q in p["padding"]), tuple(p["rhs_dilation"]),
                        tuple(p["lhs_dilation"]), int(p["feature_group_count"]),
                        int(lhs[dn.lhs_spec[1]]),
                        int(e.outvars[0].aval.shape[dn.out_spec[1]]),
                        int(p["batch_group_count"]))
    return M.pool_window(p["window_dimensions"], p["window_strides"], p["padding"],
                         p["base_dilation"], p["window_dilation"], lhs_spec,
                         int(e.invars[0].aval.shape[lhs_spec[1]]))


def _refusal(text: str) -> Reason:
    return Reason("branches", text)


# branches read as such that do not merge, and why
_NOT_MERGED = {**M.NOT_MERGED, "guarded": Reason(
    "weights-not-known", "the branches' weights are inputs, folded in the graph under "
    "run-time guards; they merge where they are known (hlofold.fold prepares them, "
    "freeze= bakes them in) or with in_graph='prepared'")}


def _op_name(e) -> str:
    if e.primitive.name == "custom_jvp_call":
        return "a custom_jvp function such as jax.nn.relu"
    name = e.params.get("name") if e.primitive.name in ("pjit", "jit") else None
    return name if isinstance(name, str) else e.primitive.name


class _Group:
    """One input's branches in one sum: their structure (the core's plan) first, values
    after (on the host or in a trace)."""

    def __init__(self, view, leaves: list[M.Leaf]):
        self.view = view
        self.leaves = leaves
        target = next(lf.base for lf in leaves if lf.kind in ("conv", "pair", "guarded")
                      and lf.base.primitive.name == _CONV)
        self.target = target
        self.dn = target.params["dimension_numbers"]
        self.axis = self.dn.out_spec[1]
        self.shape = tuple(target.outvars[0].aval.shape)
        self.channels = int(self.shape[self.axis])

    def structure(self, lf: M.Leaf) -> M.Term | Reason:
        """The term of a leaf without values (``kernel`` None), or why it is none."""
        if lf.kind in _NOT_MERGED:
            why = _NOT_MERGED[lf.kind]
            return why.then(f" ({_op_name(lf.base)})") if lf.kind == "nonlinear" else why
        dn, n = self.dn, len(self.dn.lhs_spec) - 2
        prod = lambda v: _producer(self.view, v)
        for part in ([lf] if lf.first is None or lf.kind != "pair" else [lf, lf.first]):
            part.steps = []
            for e, pos in reversed(part.chain):
                st = affine_step(e, pos, self.axis, prod)
                if not isinstance(st, AffineStep):
                    return _refusal("a branch's arithmetic is not per output channel "
                                    f"({st.reason})")
                part.steps.append(st)
        if lf.kind in ("identity", "pool") and tuple(dn.lhs_spec) != tuple(dn.out_spec):
            return _refusal("the convolution's input and output layouts differ, so an "
                            "identity or pool branch has no kernel in it")
        if lf.kind == "identity":
            if tuple(lf.x.aval.shape) != self.shape:
                return _refusal("a value of another shape")
            return M.Term("identity", M.depthwise_window(self.channels, (1,) * n, (1,) * n,
                                                         ((0, 0),) * n), None)
        base = lf.base
        w = _window(base, dn.lhs_spec)
        if w is None or (base.primitive.name == _CONV and
                         tuple(base.params["dimension_numbers"].out_spec) != tuple(dn.out_spec)):
            return _refusal(f"a branch's {base.primitive.name} has another layout")
        if lf.kind != "pair":
            return M.Term(lf.kind, w, None, handle=base if lf.kind == "conv" else None)
        w1 = _window(lf.first.base, dn.lhs_spec)
        if w1 is None:
            return _refusal("the first convolution of a pair has another layout")
        return M.pair_structure(w1, w, base, base.primitive.name == _CONV)

    @staticmethod
    def kernels(lf: M.Leaf) -> list:
        """The kernels the term of ``lf`` reads."""
        return [p.base.invars[1] for p in [lf] + ([lf.first] if lf.kind == "pair" else [])
                if p.base is not None and p.base.primitive.name == _CONV]

    def needs(self, lf: M.Leaf) -> list:
        """The atoms whose values the term of ``lf`` is made of."""
        parts = [lf] + ([lf.first] if lf.kind == "pair" else [])
        return [a for a in [st.operand.source for p in parts for st in p.steps
                            if st.operand is not None]
                + self.kernels(lf) if isinstance(a, C.Var)]

    def term(self, lf: M.Leaf, s: M.Term, get, xp) -> M.Term | Reason:
        """The term with values: ``get(atom)`` a known value (host) or a traced one."""
        c = self.channels
        t = dataclasses.replace(s)
        if lf.kind == "identity":
            t.kernel = M.identity_kernel(c, len(s.window.size))
        elif lf.kind == "pool":
            t.kernel = np.ones((c, 1) + s.window.size)
        if lf.kind == "pair":
            return self._pair(lf, get, xp)
        if lf.kind == "conv":
            t.kernel = _canonical(get(lf.base.invars[1]), lf.base)
        t.scale, t.shift = _affine(lf.steps, [None if st.operand is None else get(st.operand)
                                              for st in lf.steps], c, xp)
        return t

    def _pair(self, lf: M.Leaf, get, xp) -> M.Term | Reason:
        dn = self.dn

        def part(p: M.Leaf, kind: str, channels: int) -> M.Term:
            w = _window(p.base, dn.lhs_spec)
            k = (_canonical(get(p.base.invars[1]), p.base) if p.base.primitive.name == _CONV
                 else np.ones((w.out_channels, 1) + w.size))
            return M.Term(kind, w, k, *_affine(p.steps, [
                None if st.operand is None else get(st.operand) for st in p.steps],
                channels, xp), handle=p.base)
        first = part(lf.first, "conv", int(lf.first.base.outvars[0].aval.shape[
            lf.first.base.params["dimension_numbers"].out_spec[1]]))
        second = part(lf, "conv" if lf.base.primitive.name == _CONV else "pool", self.channels)
        sp = [int(lf.base.invars[0].aval.shape[d]) for d in dn.lhs_spec[2:]]
        osp = [int(self.shape[d]) for d in dn.out_spec[2:]]
        return M.compose(first, second, sp, osp, np if xp is np64 else jnp)


def _canonical(k, eqn):
    """A kernel in the core's ``(O, I/G, *window)`` layout."""
    spec = tuple(eqn.params["dimension_numbers"].rhs_spec)
    return jnp.transpose(k, spec) if not isinstance(k, np.ndarray) else np.transpose(k, spec)


def _affine(steps, vals, channels, xp):
    if not steps:
        return None, None
    s, t = collapse([st.kind for st in steps], vals, channels, xp=xp)
    return (s if has_scale(steps) else None), (t if has_shift(steps) else None)


def merge_scope(view, in_graph: str, path: str, sites: list,
                write: bool = True) -> C.ClosedJaxpr | None:
    """Merge the branch sums of ``view`` (a scope over a folded program); the program with
    each merged sum rewritten (its branches left dead), or None when nothing merges.
    ``write=False`` (``fold_params``): record the merges as not written, rewrite nothing."""
    eqns = view.jaxpr.eqns
    replaced: dict[int, list] = {}
    constvars, consts = list(view.jaxpr.constvars), list(view.closed.consts)
    taken: set = set()           # the not-reached norms merges took
    for i, e in enumerate(eqns):
        if e.primitive.name != "add" or not _is_top(view, e):
            continue
        new = _merge_tree(view, e, in_graph, path, sites, constvars, consts, write, taken)
        if new is not None:
            replaced[_at(i, new[1])] = new[0]
    drop_unreached(sites, path, taken)
    if not replaced:
        return None
    out = []
    for i, e in enumerate(eqns):
        out.extend(replaced.get(i, [e]))
    return C.closed_jaxpr(view.jaxpr.replace(constvars=constvars, eqns=out), consts)


def _is_top(view, e) -> bool:
    o = e.outvars[0]
    uses = view.uses.get(o, ())
    return not (_single(view, o) and view.jaxpr.eqns[uses[0][0]].primitive.name == "add")


def _tree_leaves(view, top) -> list:
    out = []
    for a in top.invars:
        e = _producer(view, a)
        if e is not None and e.primitive.name == "add" and _single(view, a):
            out.extend(_tree_leaves(view, e))
        else:
            out.append(a)
    return out


def _merge_tree(view, top, in_graph, path, sites, constvars, consts, write, unreached):
    shape = tuple(top.outvars[0].aval.shape)
    atoms = _tree_leaves(view, top)
    leaves = [_read(view, a) if isinstance(a, C.Var) and tuple(a.aval.shape) == shape
              else None for a in atoms]
    groups = M.group_leaves(leaves, lambda v: _single(view, v))
    merges, taken = [], set()
    for ks in groups:
        g = _Group(view, [leaves[k] for k in ks])
        # the sum's per-channel biases join the first merge's bias
        biases = {} if merges else {k: op for k, a in enumerate(atoms) if k not in ks and (
            op := _operand(view, a, shape, g.axis)) is not None}
        # an affine after a sum of these branches and biases alone joins the merge
        after = _walk_forward(view, top.outvars[0], g.axis, g.channels) if (
            len(groups) == 1 and len(ks) + len(biases) == len(atoms)) else None
        m = merge_group(view, g, in_graph, path, sites, write, list(biases.values()), after)
        if m is not None:
            merges.append(m)
            unreached.update(unreached_keys(m.members.values()))
            if m.after is not None:
                unreached.update((C.user_location(st.eqn), C.name_stack(st.eqn))
                                 for st in m.after.steps)
            taken.update(k for k in ks if any(leaves[k] is lf for lf in m.members.values()))
            taken.update(k for k, op in biases.items() if op in m.biases)
    if not merges:
        return None
    return splice(view, top, merges, [a for k, a in enumerate(atoms) if k not in taken],
                  constvars, consts), merges


def _at(top_index: int, merges) -> int:
    """Where the merged equations go: the sum's place, or the last absorbed step's."""
    return max([top_index] + [m.after.last for m in merges if m.after is not None])
