"""Solving a folded site's parameters back to identities, for :func:`hlofold.fold_params`.

For each folded site, the :class:`Writer` assigns the kernel leaf ``K ⊙ s`` and solves every
parameter the chain read (through the parameter-only computation the model does with it:
``rsqrt(σ² + ε)·γ``, casts, reshapes) for the value that makes the *unchanged* model compute
an identity there, one bias slot carrying the folded shift. A leaf is changed only when
every use of it belongs to the sites written back.
"""
from __future__ import annotations

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._base.algebra import along, collapse, input_scale
from hlofold._fold.jaxpr.steps import AffineStep, place_target

NO_SLOT = ("the layer has no bias parameter to carry the folded shift (t = β − μ·s, or β·W "
           "for a norm folded forward)")
BIAS_MAP = ("the shift in front of a padded convolution becomes a bias per output position "
            "(its border sees less of it); no parameter of the layer holds one")
# the values as they are (maybe rounded), their positions moved
_LAYOUT = ops.names(lambda o: o.shape in ("cast", "copy", "reshape", "squeeze", "transpose",
                                          "broadcast", "constraint") or o.rounding == "always")


def _device_scaled(k: jax.Array, factors: list) -> jax.Array | None:
    """``K`` times the float64 ``factors`` (each broadcasting against it), computed on
    ``K``'s devices in float32 (float64 where enabled: JAX computes in float32 otherwise) and
    kept in its sharding; None where the result is not finite."""
    import jax.numpy as jnp
    ct = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32

    def scale(k):
        y = k.astype(ct)
        for f in factors:
            y = y * jnp.asarray(f, ct)
        return y.astype(k.dtype), jnp.all(jnp.isfinite(y.astype(k.dtype)))
    out, ok = jax.jit(scale, out_shardings=(k.sharding, None))(k)
    return out if bool(ok) else None


class Writer:
    """Solves each site's parameters back to identities; ``assign``: leaf index → value."""

    def __init__(self, scope, param_vars, deferred: dict):
        self.scope = scope
        self.deferred = deferred          # leaf index -> a kernel rescaled on its devices
        self.leaf = {v: i for i, v in enumerate(param_vars)}
        self.assign: dict[int, np.ndarray] = {}
        self.param_only = self._param_only()

    def group(self, group):
        """Write back ``group`` (sites sharing a norm) together: ``[(kernel, bias, solved,
        front)]`` per site, or the reason none is written."""
        if group[0].fwd is not None:
            top = group[0].eqn.invars[group[0].fwd.act]
            readers = {id(self.scope.jaxpr.eqns[j]) for j, _ in self.scope.uses.get(top, [])}
            if readers != {id(s.eqn) for s in group} or self.scope.out_uses.get(top):
                return ("the normalized value has a consumer whose fold is refused; its "
                        "norm must stay as it is")
        got = self._sites(group, False)
        if got in (NO_SLOT, BIAS_MAP) and group[0].fwd is not None:
            kept = self._sites(group, True)      # the front's shift kept there, as t/s
            return got if isinstance(kept, str) else kept
        return got

    def _sites(self, group, keep_front: bool):
        saved, out = dict(self.assign), []
        for site in group:
            got = self.site(site, keep_front)
            if isinstance(got, str):
                self.assign = saved
                return got
            out.append(got)
        return out

    def _constant_tail(self, back) -> list:
        """``[(step, value)]``: the steps ending the chain whose operand is one constant of
        the program, no parameter (the ``1/√head_dim`` an attention scales its query by
        after the projection's bias). No leaf can hold them; they stay where they are and
        the write-back folds the chain before them."""
        tail: list = []
        for st in reversed(back):
            src = st.operand.source
            if st.kind not in ("mul", "div", "add", "sub") or \
                    (not isinstance(src, C.Literal) and self.scope.names(src)):
                break
            v = src.val if isinstance(src, C.Literal) else self.scope.value(src)
            if v is None or np.size(v) != 1:
                break
            tail.insert(0, (st, float(np.asarray(v, np.float64).reshape(()))))
        return tail

    def _before_tail(self, site, kernel, tail, t):
        """``(kernel, bias)`` of the chain without its constant ``tail``: the kernel computed
        again from the leaf (``K ⊙ s_before``, forward factors too; rounded once) and
        ``(t − t_tail) / s_tail``; None where that is not known or not finite."""
        info, fwd = site.info, site.fwd
        s_tail, t_tail = collapse([st.kind for st, _ in tail], [c for _, c in tail],
                                  info.out_channels)
        s_tail = 1.0 if s_tail is None else float(s_tail)
        t_tail = 0.0 if t_tail is None else float(t_tail)
        k = self._current(kernel, {})
        if k is None or s_tail == 0 or not np.isfinite(s_tail) or \
                (fwd is not None and fwd.s_known is None):
            return None
        nd, ko = len(kernel.aval.shape), info.kernel_axis
        s_before = (1.0 if site.s_known is None else np.asarray(site.s_known, np.float64)) \
            / s_tail
        with np.errstate(all="ignore"):
            y = k * along(np.broadcast_to(s_before, (info.out_channels,)), ko, nd)
            if fwd is not None:
                y = y * input_scale(fwd.s_known, ko, fwd.k_in_axis, fwd.groups,
                                    info.out_channels, nd)
            y = y.astype(kernel.aval.dtype)
            t = (t - t_tail) / s_tail
        if not (np.all(np.isfinite(y)) and np.all(np.isfinite(t))):
            return None
        return y, t

    def _row_read(self, var) -> bool:
        """Whether ``var`` is a ``dynamic_slice`` (through reshapes, squeezes, casts) of a
        value the scope does not know now: a stack's row at a loop counter."""
        for _ in range(8):
            eqn = next((e for e in self.scope.jaxpr.eqns if var in e.outvars), None)
            if eqn is None:
                return False
            if eqn.primitive.name == "dynamic_slice":
                return True
            if eqn.primitive.name not in ("reshape", "squeeze", "convert_element_type"):
                return False
            var = eqn.invars[0]
        return False

    def site(self, site, keep_front: bool = False):
        """``(kernel leaf, bias leaf or None, leaves solved to identities, the leaf keeping
        the front's shift or None)`` or the reason it is kept.
        ``keep_front``: a shift in front of the layer (a norm's β, a BN's shift before a
        padded convolution) stays there as ``t/s`` — the scale ``s`` in the kernel, the
        front's scales identities — where no bias of the layer can carry ``t·K``."""
        info, fwd = site.info, site.fwd
        kernel = site.eqn.invars[info.kernel_index]
        if kernel not in self.leaf and self._kernel_back(kernel, None) is None:
            if self._row_read(kernel):
                return ("the kernel is one row of a stacked parameter read at a loop's "
                        "counter (fori_loop's params[\"K\"][i]), which is not written back; "
                        "hlofold.fold folds it per layer")
            return ("the kernel is computed from the parameters (e.g. tied to an embedding, "
                    "or changed in value), not a leaf of its own reshaped, transposed or "
                    "reversed")
        kernel_value = site.kernel_const
        deferred = kernel in self.leaf and self.leaf[kernel] in self.deferred
        if kernel_value is None and deferred and site.s_known is not None and (
                fwd is None or (fwd.s_known is not None and not fwd.has_shift)):
            nd, ko = len(kernel.aval.shape), info.kernel_axis
            factors = [along(site.s_known, ko, nd)] + ([] if fwd is None else [input_scale(
                fwd.s_known, ko, fwd.k_in_axis, fwd.groups, info.out_channels, nd)])
            kernel_value = _device_scaled(self.deferred[self.leaf[kernel]], factors)
            if kernel_value is None:
                return "the rescaled kernel is not finite"
        if kernel_value is None:
            return "the folded kernel is not known at transform time"
        if site.bias_map is not None and not keep_front:
            return BIAS_MAP
        back = [s for s in site.steps if isinstance(s, AffineStep)]
        front = fwd.steps if fwd is not None else []
        if any(s.kind not in ("add", "sub", "mul", "div") for s in back + front):
            return "the chain negates or subtracts from a parameter (no identity to write)"
        t = site.t_back if keep_front else site.t_known
        t = np.zeros(info.out_channels) if t is None else np.asarray(t, np.float64)
        front_t = self._front_shift(fwd) if keep_front else None
        if keep_front and front_t is None:
            return "the shift in front of the layer cannot stay there as t/s"
        tail = self._constant_tail(back)
        if tail:           # constants at the chain's end stay in the program, folded before
            got = self._before_tail(site, kernel, tail, t)
            if got is None:
                return (f"{tail[0][0].eqn.primitive.name} by a constant ends the chain, and the "
                        "kernel without it is not known at transform time")
            kernel_value, t = got
            back = back[:len(back) - len(tail)]
            if site.record is not None:
                site.record.note = (f"{'·'.join(st.kind for st, _ in tail)} by a constant "
                                    "left in the program (no parameter holds it)")
        shifts = [s for s in back if s.kind in ("add", "sub")]
        slot = next((s for s in shifts if s.kind == "add" and
                     self._is_leaf(s.operand.source)), None) or \
            next((s for s in shifts if self._is_leaf(s.operand.source)), None) or \
            (shifts[-1] if shifts else None)
        if slot is None and np.any(t != 0):
            return NO_SLOT
        targets = [(s, 1.0) for s in back + front if s.kind in ("mul", "div")]
        f_slot = None if front_t is None else front_t[0]
        targets += [(s, (front_t[1] if s.kind == "add" else -front_t[1]) if s is f_slot
                     else 0.0) for s in front if s.kind in ("add", "sub")]
        targets += [(s, (t if s.kind == "add" else -t) if s is slot else 0.0) for s in shifts]
        trial = dict(self.assign)
        k_leaf, kernel_value = self._kernel_back(kernel, kernel_value)
        trial[k_leaf] = kernel_value          # (its dtype: no float64 copy)
        for step, target in targets:
            op = step.operand
            tv = place_target(target, op)
            if tv is None or not self._solve(op.source, tv, trial):
                return f"{step.eqn.primitive.name}'s operand has no identity this can write"
        changed = set(trial) - set(self.assign) | {i for i in trial if i in self.assign and
                                                    trial[i] is not self.assign[i] and
                                                    not np.array_equal(trial[i],
                                                                       self.assign[i])}
        why = self._uses_outside(changed, site)
        if why:
            return why
        self.assign = trial
        bias = None if slot is None else self._leaf_of(slot.operand.source)
        front = None if f_slot is None else self._leaf_of(f_slot.operand.source)
        return k_leaf, bias, changed - {front}, front

    def _front_shift(self, fwd):
        """``(step, t/s)``: the front's add of a leaf to hold its shift ``t`` over its scale
        ``s`` once its scales are identities; None where there is none, or ``s`` is 0
        where ``t`` is not."""
        if fwd is None or fwd.s_known is None or fwd.t_known is None:
            return None
        held = [st for st in fwd.steps if st.kind in ("add", "sub") and
                self._is_leaf(st.operand.source)]
        step = next((st for st in held if st.kind == "add"), held[0] if held else None)
        s_in, t_in = (np.asarray(x, np.float64) for x in (fwd.s_known, fwd.t_known))
        if step is None or np.any((s_in == 0) & (t_in != 0)):
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(t_in == 0, 0.0, t_in / np.where(s_in == 0, 1.0, s_in))
        return (step, q) if np.all(np.isfinite(q)) else None

    def _kernel_back(self, v, value):
        """``(leaf, value in the leaf's layout)`` for a kernel computed from one parameter
        leaf by reshapes, transposes and reversals only (Keras' ``DepthwiseConv2D`` reshapes
        its kernel, ``Conv2DTranspose`` reverses and transposes it): the folded kernel
        ``value`` taken back through their inverses, in its dtype. None for any other
        computation (``value`` None: only whether there is such a path)."""
        while v not in self.leaf:
            e = self.scope.producer.get(v, (0, None))[1] if isinstance(v, C.Var) else None
            name = None if e is None else e.primitive.name
            if (name == "reshape" and e.params.get("dimensions") is None) or name == "squeeze":
                value = None if value is None else np.reshape(value, e.invars[0].aval.shape)
            elif name == "transpose":
                value = None if value is None else np.transpose(
                    value, np.argsort(e.params["permutation"]))
            elif name == "rev":
                value = None if value is None else np.flip(value, tuple(e.params["dimensions"]))
            elif name != "sharding_constraint":       # (a constraint: the values as they
                return None                           # are; a jit's in_shardings inlined)
            v = e.invars[0]
        return self.leaf[v], value

    # ---- solving a parameter computation for a target value

    def _is_leaf(self, v) -> bool:
        return self._leaf_of(v) is not None

    def _leaf_of(self, v):
        while isinstance(v, C.Var) and v not in self.leaf and v in self.scope.producer:
            e = self.scope.producer[v][1]
            if e.primitive.name not in _LAYOUT:
                return None
            v = e.invars[0]
        return self.leaf.get(v)

    def _current(self, v, trial):
        """The value of a parameter computation with the assignments so far."""
        if isinstance(v, C.Literal):
            return np.asarray(v.val, np.float64)
        if v in self.leaf:
            i = self.leaf[v]
            return trial[i] if i in trial else np.asarray(self.scope.value(v), np.float64)
        e = self.scope.producer.get(v, (0, None))[1]
        if e is None or not self._leaves(v).intersection(trial):
            val = self.scope.value(v)
            return None if val is None else np.asarray(val, np.float64)
        ins = [self._current(u, trial) for u in e.invars]
        if any(x is None for x in ins):
            return None
        out = C.bind_eqn(e, [np.asarray(x).astype(u.aval.dtype)
                             for x, u in zip(ins, e.invars)])[0]
        return np.asarray(out, np.float64)

    def _leaves(self, v) -> set:
        cone = self.scope.cone(v, limit=64) or set()
        return {self.leaf[u] for u in cone if u in self.leaf}

    def _solve(self, v, T, trial) -> bool:      # noqa: C901 — one case per primitive
        T = np.broadcast_to(np.asarray(T, np.float64), tuple(v.aval.shape))
        if isinstance(v, C.Literal) or v not in self.scope.producer and v not in self.leaf:
            cur = self._current(v, trial)
            return cur is not None and np.allclose(cur, T, rtol=1e-6, atol=1e-12)
        if v in self.leaf:
            i = self.leaf[v]
            if i in trial:
                return np.allclose(trial[i], T, rtol=1e-6, atol=1e-12)
            trial[i] = np.array(T)
            return True
        e = self.scope.producer[v][1]
        name, ins = e.primitive.name, e.invars
        if not self.param_only.get(v, False):
            return False
        if name in ("convert_element_type", "copy", "reduce_precision"):
            return self._solve(ins[0], T, trial)
        if name in ("reshape", "squeeze"):
            return self._solve(ins[0], T.reshape(ins[0].aval.shape), trial)
        if name == "transpose":
            return self._solve(ins[0], np.transpose(T, np.argsort(e.params["permutation"])),
                               trial)
        if name == "broadcast_in_dim":
            dims, src = tuple(e.params["broadcast_dimensions"]), ins[0].aval.shape
            keep = [d in dims and src[dims.index(d)] != 1 for d in range(T.ndim)]
            sl = T[tuple(slice(None) if k else slice(0, 1) for k in keep)]
            if not np.array_equal(np.broadcast_to(sl, T.shape), T):
                return False
            return self._solve(ins[0], sl.reshape(src), trial)
        if name == "neg":
            return self._solve(ins[0], -T, trial)
        if name == "rsqrt":
            return bool(np.all(T > 0)) and self._solve(ins[0], 1.0 / T ** 2, trial)
        if name == "sqrt":
            return bool(np.all(T >= 0)) and self._solve(ins[0], T ** 2, trial)
        if name in ("square", "integer_pow") and e.params.get("y", 2) == 2:
            return bool(np.all(T >= 0)) and self._solve(ins[0], np.sqrt(T), trial)
        if name not in ("add", "sub", "mul", "div") or len(ins) != 2:
            return False
        a, b = ins
        fixed = [not self._leaves(u) if isinstance(u, C.Var) else True for u in (a, b)]
        if fixed[0] != fixed[1]:                 # one side is a constant (ε): solve the other
            k = 1 if fixed[0] else 0
            c = self._current(ins[1 - k], trial)
            if c is None:
                return False
            with np.errstate(divide="ignore", invalid="ignore"):
                x = {("add", 0): T - c, ("add", 1): T - c, ("sub", 0): T + c,
                     ("sub", 1): c - T, ("mul", 0): T / c, ("mul", 1): T / c,
                     ("div", 0): T * c, ("div", 1): c / T}[(name, k)]
            return bool(np.all(np.isfinite(x))) and self._solve(ins[k], x, trial)
        if fixed[0]:
            cur = self._current(v, trial)
            return cur is not None and np.allclose(cur, T, rtol=1e-6, atol=1e-12)
        if name in ("add", "sub"):
            return self._solve(a, T, trial) and self._solve(b, np.zeros_like(T), trial)
        if name == "mul" and not np.any(T):      # a product to zero: its unassigned side
            free = [u for u in (a, b) if not self._leaves(u).intersection(trial)]
            return bool(free) and self._solve(free[0], T, trial)
        return self._solve(a, T, trial) and self._solve(b, np.ones_like(T), trial)

    # ---- every use of a changed leaf belongs to the site

    def _param_only(self) -> dict:
        """Variables computed from parameters and constants only."""
        po = {v: True for v in self.leaf}
        po.update({v: True for v in self.scope.jaxpr.constvars})
        for e in self.scope.jaxpr.eqns:
            ok = not e.effects and all(isinstance(u, C.Literal) or po.get(u, False)
                                       for u in e.invars)
            for o in e.outvars:
                po[o] = ok or o in self.leaf     # (a leaf computed in the body: a stack's row)
        return po

    def _uses_outside(self, changed: set, site) -> str | None:
        eqns = self.scope.jaxpr.eqns
        own = [site.eqn] + [s.eqn for s in site.steps] + \
            ([s.eqn for s in site.fwd.steps] if site.fwd is not None else [])
        mine = {id(e) for e in own}
        for e in own:                  # and the ops computing their operands (r ⊗ γ)
            for u in e.invars:
                p = self.scope.producer.get(u) if isinstance(u, C.Var) else None
                if p is not None:
                    mine.add(id(p[1]))
        inv = {i: v for v, i in self.leaf.items()}
        for i in changed:
            stack, seen = [inv[i]], {inv[i]}
            while stack:
                u = stack.pop()
                if u in self.scope.out_uses:
                    return "a changed parameter is also an output of the program"
                for j, _ in self.scope.uses.get(u, []):
                    e = eqns[j]
                    if all(self.param_only.get(o, False) for o in e.outvars):
                        for o in e.outvars:
                            if o not in seen:
                                seen.add(o)
                                stack.append(o)
                    elif id(e) not in mine:
                        f, line, _ = C.user_location(e)
                        return (f"a parameter it changes is also read by {e.primitive.name}"
                                f" ({f}:{line}), outside the folded sites")
        return None
