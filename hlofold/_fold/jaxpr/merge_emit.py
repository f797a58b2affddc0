"""A jaxpr branch merge decided and written: values on the host or in the graph, the report
record, and the merged ``conv + bias`` spliced in place of the sum (``_fold.jaxpr.merge`` reads
the branches)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlofold import _compat as C
from hlofold._fold.core import merge as M
from hlofold._base.algebra import np64
from hlofold._base.chain_rules import ChannelOperand
from hlofold._fold.core.patterns import conv_layout
from hlofold._base.reasons import Reason
from hlofold._base.report import MERGED, NOT_REACHED, REFUSED, FoldSite
from hlofold._fold.core.rules import round_kernel
from .arith import cast, lax_arith

IN_GRAPH = ("prepared", "unguarded")     # in_graph modes a merge of input weights is staged


@dataclasses.dataclass
class Merge:
    """A decided merge: the group, the core's plan over its terms, and its values — known
    (``kernel``, ``shift``, ``shift_map``) or computed in the trace (``needs``)."""

    group: Any
    plan: M.Plan
    terms: list
    x: Any
    target: Any                     # the conv equation the merged one is written as
    groups: int
    kernel: Any = None
    shift: Any = None
    shift_map: Any = None
    needs: list = dataclasses.field(default_factory=list)
    members: dict = dataclasses.field(default_factory=dict)     # term index -> leaf
    biases: list = dataclasses.field(default_factory=list)      # the sum's biases taken
    after: Any = None               # the affine after the sum it absorbed (``_fold.jaxpr.merge``)


def _names(view, atoms) -> list[str]:
    return sorted({n for a in atoms if isinstance(a, C.Var) for n in view.names(a) if n})


def _host_get(view):
    """``atom or ChannelOperand -> float64 value`` of known values (the scope's readers)."""
    def get(a):
        if isinstance(a, ChannelOperand):
            return np.asarray(view.operand_value(a), np.float64)
        return np.asarray(view.value(a), np.float64)
    return get


# fold_params: a merge changes the program, which a parameter tree cannot express
NOT_WRITTEN = Reason("not-written", "not written back: the branches merge into one "
                     "convolution only in a program (a parameter tree of the trained form "
                     "cannot hold it; each branch's BatchNorm is written into its own "
                     "convolution); the deploy program comes from hlofold.lower/export(..., "
                     "freeze=) or fold_stablehlo(..., params=)")


def _known(view, a) -> bool:
    src = a.source if isinstance(a, ChannelOperand) else a
    return not isinstance(src, C.Var) or view.value(src) is not None


def merge_group(view, g, in_graph: str, path: str, sites: list, write: bool = True,
                biases=(), after=None) -> Merge | None:
    """Decide the merge of group ``g`` (``_fold.jaxpr.merge._Group``) and record it (with
    ``write`` False, only say that it would merge and cannot be written back); ``biases``:
    the sum's per-channel terms (ChannelOperands), added to the merged bias; ``after``: the
    affine after the sum (``_fold.jaxpr.merge.After``), absorbed when every branch merges."""
    structs = [g.structure(lf) for lf in g.leaves]
    ok = [i for i, s in enumerate(structs) if isinstance(s, M.Term)]
    terms = [structs[i] for i in ok]
    p = M.plan(terms) if len(terms) >= 2 else next(
        s for s in structs if not isinstance(s, M.Term))
    if isinstance(p, Reason):
        _record(view, g.target, g, path, sites, REFUSED, reason=p,
                absorbed=[s.describe() if isinstance(s, M.Term) else M.leaf_label(lf.kind)
                          for s, lf in zip(structs, g.leaves)])
        return None
    members = {j: g.leaves[ok[j]] for j in p.members}
    needs = list(dict.fromkeys(a for lf in members.values() for a in g.needs(lf)))
    # (a bias not known now stays added after, unless the merge is staged in the graph)
    b_known = [b for b in biases if _known(view, b)]
    # the affine after the sum joins a merge of every branch; merged on the host, with its
    # own values and the sum's biases known too (values not known yet: the refusal below
    # names them, to be prepared; staged in the graph: computed there)
    on_host = in_graph not in IN_GRAPH and all(_known(view, a) for a in needs)
    if after is not None and (len(members) < len(g.leaves) or (on_host and not (
            len(b_known) == len(biases) and all(_known(view, a) for a in after.needs())))):
        after = None
    if after is not None:
        needs = list(dict.fromkeys(needs + [a for a in after.needs() if isinstance(a, C.Var)]))
    kernels = [k for lf in members.values() for k in g.kernels(lf)]
    target = terms[p.target].handle
    tw = terms[p.target].window
    absorbed, note = M.describe(terms, p, [(M.leaf_label(lf.kind), st) for st, lf in zip(
        structs, g.leaves) if not isinstance(st, M.Term)])
    if after is not None:
        absorbed = absorbed + ["·".join(st.kind for st in after.steps) + " after the sum"]
    kw = dict(absorbed=absorbed, params=_names(view, [a for a in needs if a not in kernels]
                                               + [b.source for b in biases]),
              kernel=", ".join(_names(view, kernels)) or None)
    unknown = [a for a in needs if isinstance(a, C.Var) and view.value(a) is None]
    if not write:
        _record(view, target, g, path, sites, REFUSED, reason=NOT_WRITTEN.then(f" ({note})"),
                groups=tw.groups, **kw)
        return None
    m = Merge(g, p, terms, g.leaves[0].x, target, tw.groups, members=members,
              biases=b_known, after=after)
    if not unknown:
        get = _host_get(view)
        s_a, t_a = after.affine(get, np64) if after is not None else (None, None)
        for j, lf in members.items():
            t = g.term(lf, terms[j], get, np64)
            if isinstance(t, Reason):
                _record(view, target, g, path, sites, REFUSED, reason=t, **kw)
                return None
            m.terms[j] = M.then_affine(t, s_a)
        k64 = M.merged_kernel(m.terms, p, np)
        spec = tuple(target.params["dimension_numbers"].rhs_spec)
        kd = np.dtype(target.invars[1].aval.dtype)
        m.kernel, why = round_kernel(np.transpose(k64, np.argsort(spec)), [], kd, spec[0])
        if why is not None:
            _record(view, target, g, path, sites, REFUSED, reason=why, **kw)
            return None
        m.shift, m.shift_map = M.merged_shift(m.terms, p, np)
        for b in b_known:
            v = get(b) if s_a is None else get(b) * s_a
            m.shift = v if m.shift is None else m.shift + v
        if t_a is not None:
            m.shift = t_a if m.shift is None else m.shift + t_a
        _record(view, target, g, path, sites, MERGED, note=note, rescale="constant",
                groups=tw.groups, **kw)
        return m
    if in_graph not in IN_GRAPH:
        why = Reason("weights-not-known", "the branches' weights are not known at transform "
                     "time, so the merged kernel would be computed on every call; "
                     "hlofold.fold prepares them once, freeze= bakes them in")
        _record(view, target, g, path, sites, REFUSED, reason=why, **kw)
        return None
    m.biases = list(biases)
    m.needs = needs + [b.source for b in biases if isinstance(b.source, C.Var)]
    _record(view, target, g, path, sites, MERGED, note=note, rescale="in-graph",
            groups=tw.groups, **kw)
    return m


def unreached_keys(leaves) -> set:
    """Where the normalizations a merge took sit (an identity branch's BatchNorm, a pool's),
    as their not-reached records name them."""
    return {(C.user_location(e), C.name_stack(e)) for lf in leaves
            for part in (lf, lf.first) if part is not None for e, _ in part.chain}


def drop_unreached(sites: list, path: str, keys: set) -> None:
    """Drop the not-reached records at ``keys`` (folded into merged convolutions now):
    once per scope, after its merges."""
    if keys:
        sites[:] = [s for s in sites if not (
            s.status == NOT_REACHED and s.scope == path and
            ((s.file, s.line, s.function), s.name_stack) in keys)]


def _record(view, eqn, g, path, sites, status, groups=None, **kw) -> None:
    file, line, fn = C.user_location(eqn)
    dn = eqn.params["dimension_numbers"]
    sites.append(FoldSite(
        pattern="branches", primitive="conv_general_dilated", status=status, scope=path,
        file=file, line=line, function=fn, name_stack=C.name_stack(eqn),
        layout=conv_layout(dn.lhs_spec, dn.rhs_spec, dn.out_spec),
        in_channels=int(eqn.invars[0].aval.shape[dn.lhs_spec[1]]),
        out_channels=g.channels, groups=groups or int(eqn.params["feature_group_count"]),
        dtype=str(eqn.outvars[0].aval.dtype), **kw))


def _traced_values(m: Merge, read):
    """The merged kernel and shift of ``m`` computed in the trace (weights are inputs)."""
    kd = np.dtype(m.target.invars[1].aval.dtype)
    cdt = np.float64 if kd.itemsize > 4 and jax.config.jax_enable_x64 else np.float32

    view = m.group.view

    def get(a):
        if isinstance(a, ChannelOperand):
            return view.operand_traced(a, read, cdt)
        return cast(read(a), cdt)

    g, p = m.group, m.plan
    terms = list(m.terms)
    s_a, t_a = m.after.affine(get, lax_arith(cdt)) if m.after is not None else (None, None)
    for j, lf in m.members.items():
        t = g.term(lf, terms[j], get, lax_arith(cdt))
        if isinstance(t, Reason):
            raise ValueError(f"a merge decided on its structure failed on values: {t}")
        if isinstance(t.kernel, np.ndarray):
            t.kernel = t.kernel.astype(cdt)
        terms[j] = M.then_affine(t, s_a, jnp)
    k = M.merged_kernel(terms, p, jnp)
    spec = tuple(m.target.params["dimension_numbers"].rhs_spec)
    k = cast(jnp.transpose(k, tuple(np.argsort(spec))), kd)
    shift, smap = M.merged_shift(terms, p, jnp)
    for b in m.biases:
        v = get(b) if s_a is None else get(b) * s_a
        shift = v if shift is None else shift + v
    if t_a is not None:
        shift = t_a if shift is None else shift + t_a
    return k, shift, smap


def splice(view, top, merges: list[Merge], rest: list, constvars: list, consts: list) -> list:
    """The equations computing ``top``'s result as the merged convolutions plus the sum's
    other terms ``rest``; new constants are appended to ``constvars``/``consts``."""
    out_var = next((m.after.out for m in merges if m.after is not None), top.outvars[0])
    shape, dtype = tuple(out_var.aval.shape), out_var.aval.dtype
    atoms = list(dict.fromkeys([m.x for m in merges] +
                               [a for a in rest if isinstance(a, C.Var)] +
                               [a for m in merges for a in m.needs if isinstance(a, C.Var)]))

    def fn(*vals):
        env = dict(zip(atoms, vals))
        read = lambda a: a.val if isinstance(a, C.Literal) else env[a]
        y = None
        for m in merges:
            k, shift, smap = ((m.kernel, m.shift, m.shift_map) if not m.needs else
                              _traced_values(m, read))
            params = dict(m.target.params, feature_group_count=m.groups)
            z = C.bind_eqn(m.target, [read(m.x), k], params)[0]
            out_spec = m.target.params["dimension_numbers"].out_spec
            if shift is not None:
                sv = cast(jnp.asarray(shift), z.dtype) if not isinstance(shift, np.ndarray) \
                    else np.asarray(shift).astype(z.dtype)
                dims = (out_spec[1],) if np.ndim(sv) else ()
                z = lax.add(z, lax.broadcast_in_dim(sv, z.shape, dims))
            if smap is not None:             # (O, *spatial) placed as (1, …) in the output
                host = isinstance(smap, np.ndarray)
                mp = (np if host else jnp).moveaxis(
                    smap[None], list(range(smap.ndim + 1)),
                    [out_spec[0], out_spec[1]] + list(out_spec[2:]))
                mp = mp.astype(z.dtype) if host else cast(mp, z.dtype)
                z = lax.add(z, lax.broadcast_in_dim(mp, z.shape, tuple(range(z.ndim))))
            y = z if y is None else lax.add(y, z)
        for a in rest:
            v = read(a)
            v = cast(jnp.asarray(v), dtype)
            if v.shape != shape:         # a scalar, or size-1 axes (lax broadcasts those)
                v = lax.broadcast_in_dim(v, shape, tuple(range(v.ndim)) if v.ndim else ())
            y = lax.add(y, v)
        return cast(y, dtype)

    with C.source_of(merges[0].target):
        sub = C.trace(fn, [a.aval for a in atoms])
    ren: dict = dict(zip(sub.jaxpr.invars, atoms))
    for cv, c in zip(sub.jaxpr.constvars, sub.consts):
        v = C.new_var(C.aval_of(c))
        constvars.append(v)
        consts.append(c)
        ren[cv] = v
    res = sub.jaxpr.outvars[0]
    return [e.replace(invars=[ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars],
                      outvars=[out_var if o is res else o for o in e.outvars])
            for e in sub.jaxpr.eqns]
