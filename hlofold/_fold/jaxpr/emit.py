"""Emission of planned jaxpr sites: the folded equations spliced into the program.

Untouched equations are kept (no retrace). Of a folded site only the parameter side is
traced (``K ⊙ s``, the bias, a guarded site's finiteness check), for all sites of a scope
together (:meth:`SiteEmitter._traced_site_eqns`), split per site; its activation side is made
of its own equations (:meth:`SiteEmitter._spliced_eqns`: the root on the rescaled kernel, the
chain's shape steps, the bias add); a site whose parameters are known only at run time gets a
guard: a ``cond`` running its original equations when the rescaled kernel or bias is not
finite. Sites with equal plans (``_ir.jaxpr.templates.template_key``) are traced once and cloned.
A forward fold's per-token factors (and the sharding constraints its input had), a bias map
and float32 kernels of a narrower conv are traced whole (:meth:`SiteEmitter._folded_value`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax import lax

from hlofold import _compat as C
from hlofold._base.algebra import collapse, kinds
from .arith import LAX_BROADCAST, along_traced, cast, input_traced, lax_arith, reduce_but
from hlofold._base.chain_rules import Block, ChannelOperand, block_values
from .steps import AffineStep, PassStep
from hlofold._ir.jaxpr.templates import clone_eqns, template_key

if TYPE_CHECKING:
    from .plan import Site

# name scope of the run-time guard of a site (a ``cond``: folded | original equations); a
# guard is already folded, so folding again leaves it alone (idempotence)
GUARD_SCOPE = "hlofold_guard"
# sites of equal plans are traced once and cloned (tests turn it off to compare: one trace each)
CLONE_TEMPLATES = True
# a site's activation side (root, shape steps, bias add, guard): its own equations, not traced
SPLICE_ACTIVATIONS = True


class _Splice(NamedTuple):
    """What is traced of a site whose activation side is spliced from its own equations:
    the rescaled kernel, the bias (None: no shift) and, for a guarded site, the ``cond``
    index (1: the fold is finite)."""
    kernel: Any
    bias: Any
    index: Any


class SiteEmitter:
    """The emission half of a jaxpr scope (``_fold.jaxpr.fold._Scope``): reads its plan (``site_at_end``,
    ``skip``, ``new_eqn``) and writes the folded program."""

    def _emit(self) -> C.ClosedJaxpr:
        """Splice the plan into the program: untouched equations are kept as they are (no
        retrace), each folded site is traced on its own and inlined where its chain ended,
        and rebuilt higher-order equations get their hoisted constants as new constvars."""
        jaxpr = self.jaxpr
        constvars, consts = list(jaxpr.constvars), list(self.closed.consts)

        def new_const(value) -> Any:
            v = C.new_var(C.aval_of(value))
            constvars.append(v)
            consts.append(value)
            return v

        site_eqns = self._all_site_eqns(new_const)
        eqns = []
        for i, eqn in enumerate(jaxpr.eqns):
            if i in self.skip:
                continue
            if i in site_eqns:
                eqns.extend(site_eqns[i])
            elif i in self.new_eqn:
                new = self.new_eqn[i]
                if len(new) == 2:        # (params, operands): an outer atom or a value each
                    params, ops = new
                    ins = [o if isinstance(o, (C.Var, C.Literal)) else new_const(o.value)
                           for o in ops]
                else:                    # (params, at, values): values inserted at ``at``
                    params, at, extra = new
                    ins = list(eqn.invars)
                    ins[at:at] = [new_const(c) for c in extra]
                eqns.append(eqn.replace(params=params, invars=ins))
            else:
                eqns.append(eqn)
        return C.closed_jaxpr(jaxpr.replace(constvars=constvars, eqns=eqns), consts)

    def _all_site_eqns(self, new_const) -> dict[int, list]:
        """The equations of every folded site of this scope, keyed by where each goes.

        All sites are traced together (one trace is much cheaper than one per site), then
        the traced equations are split by the site whose result they feed."""
        sites = [self.site_at_end[i] for i in sorted(self.site_at_end)]
        if not sites:
            return {}
        # Sites of the same structure and shapes whose rescale is entirely in the graph trace
        # to the same equations up to renaming: trace one per group, clone it for the rest.
        groups: dict[Any, list] = {}
        traced = []
        for site in sites:
            key = self._template_key(site) if CLONE_TEMPLATES else None
            if key is None or key not in groups:
                traced.append(site)
            if key is not None:
                groups.setdefault(key, []).append(site)
        out = self._traced_site_eqns(traced, new_const)
        for members in groups.values():
            first = members[0]
            atoms = self._site_atoms(first)
            for site in members[1:]:
                out[site.end_idx] = clone_eqns(out[first.end_idx], atoms,
                                                self._site_atoms(site), first.end_var,
                                                site.end_var, first.eqn, site.eqn)
        return out

    def _site_atoms(self, site) -> list:
        """The scope variables a folded site's equations read (kernel, input, operands; for
        a guarded site also every operand of its original equations)."""
        internal = {site.eqn.outvars[0]} | {st.eqn.outvars[0] for st in site.steps}
        return list(dict.fromkeys(
            [v for v in site.eqn.invars if isinstance(v, C.Var)] +
            [st.operand.source for st in site.steps + (site.fwd.steps if site.fwd else [])
             if isinstance(st, AffineStep) and st.operand is not None
             and isinstance(st.operand.source, C.Var)] +
            ([site.fwd.source] if site.fwd and isinstance(site.fwd.source, C.Var) else []) +
            ([w for _, w in site.fwd.tokens if isinstance(w, C.Var)] if site.fwd else []) +
            ([v for st in site.steps for v in st.eqn.invars
              if isinstance(v, C.Var) and v not in internal] if site.guard else [])))

    def _template_key(self, site):
        """``_ir.jaxpr.templates.template_key`` of a site; None also when an operand of its
        chains is known at transform time (its value is baked into the equations)."""
        if any(self.operand_value(st.operand) is not None
               for st in site.steps + (site.fwd.steps if site.fwd else [])
               if isinstance(st, AffineStep) and st.operand is not None):
            return None
        return template_key(site, self._site_atoms(site), self.opts)

    def _traced_site_eqns(self, sites, new_const) -> dict[int, list]:
        """Trace ``sites`` together and split the equations per site."""
        atoms = list(dict.fromkeys(v for site in sites for v in self._site_atoms(site)))
        index = {a: k for k, a in enumerate(atoms)}

        parts: list = []        # per site: a _Splice (its traced parts) or None (its result)

        def fn(*vals):
            def read(a):
                return a.val if isinstance(a, C.Literal) else vals[index[a]]
            outs = []
            for site in sites:
                r = self._emit_site(site, read)
                parts.append(r if isinstance(r, _Splice) else None)
                outs += [x for x in r if x is not None] if isinstance(r, _Splice) else [r]
            return outs

        sub = C.trace(fn, [a.aval for a in atoms])
        ren: dict[Any, Any] = dict(zip(sub.jaxpr.invars, atoms))
        ren.update((cv, new_const(c)) for cv, c in zip(sub.jaxpr.constvars, sub.consts))
        owner: dict[Any, int] = {}
        final: dict[Any, Any] = {}
        outvars = iter(sub.jaxpr.outvars)
        spliced: dict[int, _Splice] = {}
        for k, (site, part) in enumerate(zip(sites, parts)):
            if part is None:
                out = next(outvars)
                owner[out] = k
                final[out] = site.end_var
                continue
            vals = []
            for x in part:
                o = None if x is None else next(outvars)
                if isinstance(o, C.Var):
                    owner.setdefault(o, k)
                vals.append(ren.get(o, o) if isinstance(o, C.Var) else o)
            spliced[k] = _Splice(*vals)
        by_site: list[list] = [[] for _ in sites]
        for e in reversed(sub.jaxpr.eqns):
            k = next((owner[o] for o in e.outvars if o in owner), None)
            if k is None:       # feeds no site result (cannot happen: nothing is dead here)
                continue
            for v in e.invars:
                if isinstance(v, C.Var):
                    owner.setdefault(v, k)
            by_site[k].append(e.replace(
                invars=[ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars],
                outvars=[final.get(o, o) for o in e.outvars]))
        out = {site.end_idx: list(reversed(eqs)) for site, eqs in zip(sites, by_site)}
        for k, part in spliced.items():
            out[sites[k].end_idx] += self._spliced_eqns(sites[k], part)
        return out

    def _spliced_eqns(self, site: Site, part: "_Splice") -> list:
        """The activation side of a site whose parameter side was traced (``part``): the
        root on the rescaled kernel, the chain's shape steps and the bias add, made from the
        site's own equations (no trace); a guarded site's as one ``cond`` equation."""
        if part.index is None:
            return self._activation_eqns(site, {}, part.kernel, part.bias, site.end_var)
        atoms = self._site_atoms(site)
        extra = [x for x in (part.kernel, part.bias) if x is not None]
        avals = [x.aval for x in extra]
        original = self._original_branch(site, atoms, avals)
        ren = {a: C.new_var(a.aval) for a in atoms}
        ins = list(ren.values()) + [C.new_var(av) for av in avals]
        kp, tb = ins[len(atoms)], (ins[len(atoms) + 1] if part.bias is not None else None)
        end = C.new_var(site.end_var.aval)
        folded = C.jaxpr_of(ins, self._activation_eqns(site, ren, kp, tb, end), [end])
        return [C.cond_eqn(part.index, atoms + extra, (original, folded), site.end_var,
                           site.eqn.source_info, GUARD_SCOPE)]

    @staticmethod
    def _activation_eqns(site: Site, ren: dict, kp, tb, end) -> list:
        """``root(x, kp)``, the chain's shape steps, ``+ tb`` (when not None), ending in
        ``end``: the site's equations re-wired (inputs renamed by ``ren``)."""
        eqn, info = site.eqn, site.info
        ins = [ren.get(v, v) if isinstance(v, C.Var) else v for v in eqn.invars]
        ins[info.kernel_index] = kp
        y = C.new_var(eqn.outvars[0].aval)
        out = [eqn.replace(invars=ins, outvars=[y])]
        for st in site.steps:
            if isinstance(st, PassStep):
                z = C.new_var(st.eqn.outvars[0].aval)
                out.append(st.eqn.replace(invars=[y], outvars=[z]))
                y = z
        if tb is not None:
            z = C.new_var(site.end_var.aval)
            out.append(C.add_eqn(y, tb, z, eqn.source_info))
        out[-1] = out[-1].replace(outvars=[end])
        return out

    def _emit_site(self, site: Site, read):
        eqn, info, fwd = site.eqn, site.info, site.fwd
        kernel = eqn.invars[info.kernel_index]
        affine = [s for s in site.steps if isinstance(s, AffineStep)]
        end_dtype = np.dtype(site.end_var.aval.dtype)
        t = site.t_known
        with C.source_of(eqn):
            if site.kernel_const is not None:
                kp = site.kernel_const
            else:
                k = read(kernel)
                kd = np.dtype(kernel.aval.dtype)
                cdt = np.float64 if max(kd.itemsize, end_dtype.itemsize) > 4 and \
                    jax.config.jax_enable_x64 else np.float32
                xp = lax_arith(cdt)
                kc = cast(k, cdt)
                b = None
                if fwd is not None:
                    if fwd.s_known is not None:
                        s_in, t_in = fwd.s_known, fwd.t_known
                    else:
                        vals = [None if st.operand is None else
                                self.operand_traced(st.operand, read, cdt)
                                for st in fwd.steps]
                        s_in, t_in = collapse(kinds(fwd.steps), vals, info.in_channels,
                                               xp=xp)
                    nd, ko, ki = len(kernel.aval.shape), info.kernel_axis, fwd.k_in_axis
                    g, c = fwd.groups, info.out_channels
                    if fwd.has_shift:
                        b = reduce_but(xp.mul(kc, input_traced(xp.asarray(t_in), ko, ki, g, c,
                                                               nd)), ko)
                    kc = xp.mul(kc, input_traced(xp.asarray(s_in), ko, ki, g, c, nd))
                if site.s_known is not None:
                    s, t = site.s_known, site.t_known
                else:
                    vals = [None if st.operand is None else
                            self.operand_traced(st.operand, read, cdt) for st in affine]
                    s, t = collapse(kinds(affine), vals, info.out_channels, xp=xp)
                s = xp.asarray(s)
                if b is not None:
                    t = xp.add(xp.mul(s, b), xp.asarray(t))
                kp = xp.mul(kc, along_traced(s, info.kernel_axis, len(kernel.aval.shape)))
                kp = cast(kp, self._kernel_dtype(kernel))
            for e in self._kernel_constraints(kernel):   # (a jit's in_shardings, inlined:
                kp = C.bind_eqn(e, [kp])[0]             # where the kernel was, K' is)
            ok = None
            if site.guard:
                # run-time check of what transform time could not see (σ² = 0, inf γ,
                # overflow): a non-finite kernel or bias runs the site's original equations
                ok = all_finite(kp)
                if site.has_shift and not isinstance(t, np.ndarray):
                    ok = lax.bitwise_and(ok, all_finite(cast(t, end_dtype)))
            if SPLICE_ACTIVATIONS and fwd is None and site.bias_map is None and \
                    np.dtype(kp.dtype) == np.dtype(kernel.aval.dtype):
                # the activation side is made of the site's own equations, not traced
                return _Splice(kp, self._bias(site, t) if site.has_shift else None,
                               None if ok is None else lax.convert_element_type(ok, np.int32))
            if site.guard:
                return self._guarded(site, read, ok, kp, t)
            return self._folded_value(site, read, kp, t)

    def _guarded(self, site: Site, read, ok, kp, t):
        """``cond(ok, folded, original)``: both branches read the site's atoms, the
        folded one also ``kp`` and (when traced) ``t``."""
        atoms = self._site_atoms(site)
        traced_t = not isinstance(t, np.ndarray)
        n = len(atoms)

        index = {a: k for k, a in enumerate(atoms)}

        def reader(vals):
            return lambda a: a.val if isinstance(a, C.Literal) else vals[index[a]]

        def folded(*vals):
            return self._folded_value(site, reader(vals), vals[n],
                                      vals[n + 1] if traced_t else t)

        operands = [read(a) for a in atoms] + [kp] + ([t] if traced_t else [])
        original = self._original_branch(site, atoms, [C.aval_of(x) for x in operands[n:]])
        with jax.named_scope(GUARD_SCOPE):
            return C.stage_cond(ok, (original, folded), operands)

    @staticmethod
    def _original_branch(site: Site, atoms: list, extra_avals: list) -> C.ClosedJaxpr:
        """The guard's fallback: the site's original equations (root and chain) as they
        are, reading ``atoms`` (then ignoring operands of ``extra_avals``)."""
        ren: dict[Any, Any] = {a: C.new_var(a.aval) for a in atoms}
        ins = list(ren.values()) + [C.new_var(av) for av in extra_avals]
        eqns = []
        for e in [site.eqn] + [st.eqn for st in site.steps]:
            eqns.append(e.replace(
                invars=[ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars],
                outvars=[ren.setdefault(o, C.new_var(o.aval)) for o in e.outvars]))
        return C.jaxpr_of(ins, eqns, [ren[site.end_var]])

    def _kernel_constraints(self, kernel) -> list:
        """The sharding constraints the root's kernel was read through, innermost first."""
        out = []
        while isinstance(kernel, C.Var) and kernel in self.producer:
            e = self.producer[kernel][1]
            if e.primitive.name != "sharding_constraint":
                break
            out.append(e)
            kernel = e.invars[0]
        return out[::-1]

    def _folded_value(self, site: Site, read, kp, t):
        """``root(x, kp)``, the chain's shape ops replayed, plus the bias ``t``."""
        eqn, info, fwd = site.eqn, site.info, site.fwd
        kernel = eqn.invars[info.kernel_index]
        with C.source_of(eqn):
            invals = [read(v) for v in eqn.invars]
            invals[info.kernel_index] = kp
            act = 1 - info.kernel_index
            if fwd is not None:
                x = read(fwd.source)
                for kind, w in fwd.tokens:    # per-token ops stay: the root reads x·r
                    x = (lax.mul if kind == "mul" else lax.add)(x, cast(read(w), x.dtype))
                for e in fwd.passes:          # (its sharding constraints, as written)
                    x = C.bind_eqn(e, [x])[0]
                invals[act] = x
            out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
            if np.dtype(kp.dtype) != np.dtype(kernel.aval.dtype):   # float32_kernels
                invals[act] = cast(invals[act], kp.dtype)
                params = dict(eqn.params)
                if params.get("preferred_element_type") is not None:
                    params["preferred_element_type"] = np.dtype(np.float32)
                y = cast(C.bind_eqn(eqn, invals, params)[0], out_dtype)
            else:
                y = C.bind_eqn(eqn, invals)[0]
            if site.bias_map is not None:      # broadcast over the batch
                m = site.bias_map.astype(out_dtype)
                y = lax.add(y, lax.broadcast_in_dim(m, y.shape, tuple(range(m.ndim))))
            for st in site.steps:
                if isinstance(st, PassStep):
                    y = C.bind_eqn(st.eqn, [y])[0]
            if site.has_shift:
                y = lax.add(y, self._bias(site, t))
        return y

    @staticmethod
    def _bias(site: Site, t):
        """The bias ``t`` in the chain end's dtype, shaped to broadcast against it (size 1
        but along its feature axis)."""
        end_dtype = np.dtype(site.end_var.aval.dtype)
        shape = [1] * len(site.end_var.aval.shape)
        if isinstance(site.end_axis, Block):         # (heads, head_dim) channels
            return along_traced(cast(t, end_dtype), site.end_axis, len(shape))
        if isinstance(t, np.ndarray):
            tb = np.asarray(t, np.float64).astype(end_dtype)
            if tb.ndim:
                shape[site.end_axis] = tb.shape[0]
            return tb.reshape(shape)
        tb = cast(t, end_dtype)
        dims = (site.end_axis,) if tb.ndim else ()
        if tb.ndim:
            shape[site.end_axis] = tb.shape[0]
        return lax.broadcast_in_dim(tb, tuple(shape), dims)

    def operand_traced(self, op: ChannelOperand, read, cdt):
        """A per-channel operand in the trace (``read``: atom -> traced value) in ``cdt``,
        or its known value (float64)."""
        known = self.operand_value(op)
        if known is not None:
            return known.astype(np.float64)
        val = read(op.source)
        for dt in op.casts:
            val = cast(val, dt)
        if op.block is not None and op.source_axis is not None:     # (heads, head_dim)
            val = block_values(op, val, LAX_BROADCAST)
        shape = (op.size,) if op.source_axis is not None else ()
        if tuple(val.shape) != shape:
            val = lax.reshape(val, shape)
        return cast(val, cdt)


def is_guard(eqn) -> bool:
    """Whether ``eqn`` is the run-time guard of a folded site."""
    return eqn.primitive.name == "cond" and GUARD_SCOPE in C.name_stack(eqn)


def all_finite(x):
    f = lax.is_finite(x)
    return lax.reduce_and(f, tuple(range(f.ndim))) if f.ndim else f
