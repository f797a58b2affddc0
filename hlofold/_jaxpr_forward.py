"""Planning a forward fold on a jaxpr: the affine chain *in front of* a root.

``root(x·s + t, K) = root(x, K ⊙_in s) + root(t, K)`` for ``s``/``t`` per input feature. The
chain is walked back from the root's input through per-input-channel affine ops (the step
rules of ``_chain_rules``) and, for LayerNorm/RMSNorm, through *per-token* factors:

* a ``mul`` by a value constant along the feature axis (the ``rsqrt`` of a token's variance)
  is not absorbed; it stays in the graph, and the root reads ``x·r`` (:class:`Forward.tokens`).
  It commutes with per-feature scales only, so once a token factor is passed the chain takes
  ``mul``/``div``/``neg`` steps only;
* a ``mul`` by a product ``r ⊗ γ`` (Flax and Haiku write ``x · (rsqrt(var+eps)·scale)``) is
  split: ``r`` stays as a token factor, ``γ`` is absorbed.

A normalized value read by several roots (Q/K/V, gate/up) folds into each of them when every
consumer is a linear root reading it as its input features; any other consumer refuses them
all, naming it. An operand that shares an ancestor with the chain value is computed from the
activations (a statistic of the token), never a parameter.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _compat as C
from ._algebra import has_shift
from ._chain_rules import AFFINE_STEPS, AffineStep, Refusal, affine_step, resolve_operand
from ._decide import forward_consumers_refusal, forward_note
from ._patterns import FORWARD, PATTERNS, RootInfo
from ._report import FOLDED, REFUSED, FoldSite
from ._reasons import Reason
from ._rules import bias_map_refusal

_CONE_LIMIT = 256          # equations looked at per ancestry question (beyond: "activation")
_SCALE_KINDS = ("mul", "div", "neg")
# producers an elementwise consumer is not fused into: the affine in front is a pass of its own
_OWN_PASS = frozenset({"conv_general_dilated", "dot_general", "scan", "while", "cond",
                       "custom_call", "sort"})
_CALLS = frozenset(C.JIT_NAMES) | {"custom_jvp_call", "custom_vjp_call", "closed_call"}
_ELEMENTWISE = frozenset({"rsqrt", "sqrt", "exp", "log", "neg", "abs", "integer_pow",
                          "square", "convert_element_type", "add", "sub", "mul", "div",
                          "max", "min", "pow", "reduce_precision", "copy"})


def _elems(shape, skip: int | None = None) -> int:
    """Elements of ``shape`` (a symbolic dimension counts 1), without axis ``skip``."""
    return int(np.prod([d if isinstance(d, (int, np.integer)) else 1
                        for a, d in enumerate(shape) if a != skip], dtype=np.int64))


@dataclasses.dataclass
class Forward:
    """An affine chain in front of the root: ``root(x·r·s + t, K) = root(x·r, K ⊙ s) + b``."""

    steps: list                  # AffineSteps, in program order
    source: Any                  # x: the value before the chain
    k_in_axis: int               # kernel axis contracted with the input features
    groups: int
    record: FoldSite
    # per-token ops the root's input keeps, in program order: ("mul", r) or ("add", u)
    tokens: list = dataclasses.field(default_factory=list)
    act: int = 0                 # the root's operand that reads the chain
    # per spatial dimension, which taps read the input (padding, lhs dilation): the shift
    # then adds a bias map ``conv(pad(t), K)`` (``ConvAffinePattern.border_masks``)
    masks: list | None = None
    s_known: np.ndarray | None = None
    t_known: np.ndarray | None = None

    @property
    def has_shift(self) -> bool:
        return has_shift(self.steps)


class ForwardPlanner:
    """The forward-chain half of :class:`hlofold._jaxpr_plan.SitePlanner`."""

    def _plan_forward(self, eqn, pattern, info: RootInfo) -> Forward | None:
        """Follow the root's lhs back through per-input-channel affine ops. Returns the
        forward fold, or None (no chain, or refused: then recorded)."""
        act = 1 - info.kernel_index          # the operand holding the activations
        axis = pattern.input_feature_axis(eqn, act)
        if axis is None:
            return None
        producer = lambda u: self.producer.get(u, (0, None))[1]
        top = eqn.invars[act]
        v, steps, tokens, taken, reason, pending = top, [], [], [], None, []
        while isinstance(v, C.Var) and v in self.producer:
            k, e = self.producer[v]
            if e.primitive.name not in AFFINE_STEPS or k in self.claimed:
                break
            why = self._consumers_refusal(v, top, axis)
            if why:
                reason = why
                break
            cands = []
            for pos in range(len(e.invars)):
                if not isinstance(e.invars[pos], C.Var):
                    continue
                r = affine_step(e, pos, axis, producer)
                if isinstance(r, AffineStep) and (
                        r.operand is None or not self._is_activation(r.operand.source,
                                                                     e.invars[pos])):
                    cands.append((pos, r, None, None))
            if len(cands) > 1:        # a chain value is not known at transform time
                cands = [c for c in cands if self.value(e.invars[c[0]]) is None]
            if len(cands) > 1:        # and is computed, where the operand is an input
                cands = [c for c in cands if e.invars[c[0]] in self.producer
                         and c[1].operand is not None
                         and c[1].operand.source not in self.producer]
            shift = None
            if not cands and e.primitive.name == "mul":
                cands = self._token_split(e, axis, producer)
            elif not cands and e.primitive.name == "add" and not pending:
                shift = self._distributed_shift(e, axis, producer)
                cands = [] if shift is None else [shift[:4]]
            if len(cands) != 1:
                if len(cands) > 1:
                    reason = Reason("feature-axis", "both operands of the op before the root "
                                    "look per-channel")
                break
            pos, step, token, split_eqn = cands[0]
            if (tokens or pending) and step is not None and step.kind not in _SCALE_KINDS:
                break        # a shift before a per-token factor does not commute with it
            if step is not None:
                steps.append(step)
            if token is not None:
                tokens.append(("mul", token))
            tokens += [("add", u) for u in pending]
            pending = [] if shift is None else [shift[4]]
            taken += [k] + [self.producer[u][0] for u in
                            ([split_eqn] if split_eqn is not None else []) +
                            (shift[5] if shift else [])]
            v = e.invars[pos]
        if pending:                 # the product the shift distributes over was not taken
            return self._no_forward(eqn, info, Reason(
                "chain-end", "a per-token shift (LayerNorm's −μ·r·γ) without the product it "
                "distributes over"))
        self.forward_taken.update(taken)
        if not steps:
            return self._no_forward(eqn, info, reason)
        steps.reverse()
        tokens.reverse()
        fpat = FORWARD[eqn.primitive.name]
        names = sorted({n for s in steps if s.operand is not None
                        for n in self.names(s.operand.source) if n})
        ic = pattern.input_channel(eqn, act)
        absorbed = [s.eqn.primitive.name for s in steps]
        masks = pattern.border_masks(eqn) if has_shift(steps) else None
        why = next((r.reason for r in (ic, masks) if isinstance(r, Refusal)), None)
        if why is None and masks is not None:
            why = bias_map_refusal(_elems(eqn.outvars[0].aval.shape, pattern.batch_axis(eqn)),
                                   _elems(v.aval.shape), self._fused_with(v))
        if why:
            self._record(eqn, fpat, info, REFUSED, absorbed=absorbed, params=names,
                         reason=why)
            return None
        rec = self._record(eqn, fpat, info, FOLDED, absorbed=absorbed, params=names)
        rec.note = forward_note(len(tokens), self._n_consumers(top), masks is not None, reason)
        return Forward(steps, v, ic[1], info.groups, rec, tokens=tokens, act=act,
                       masks=masks)

    def _no_forward(self, eqn, info, reason: str | None) -> None:
        if reason is not None:     # an affine op was there, but could not be taken
            self._record(eqn, FORWARD[eqn.primitive.name], info, REFUSED, reason=reason)
        return None

    def _fused_with(self, v) -> str | None:
        """The op producing ``v`` when XLA computes an elementwise consumer of ``v`` in the
        same loop: anything but an input, a convolution/dot or control flow. Calls (jit,
        custom_jvp: ``jax.nn.relu``) are inlined by XLA, so their body's op counts."""
        eqn = self.producer.get(v, (0, None))[1]
        for _ in range(8):               # into (nested) calls, to the op computing v
            if eqn is None or eqn.primitive.name not in _CALLS:
                break
            body = C.call_body(eqn)[1]
            if body is None:
                return None
            v = body.jaxpr.outvars[eqn.outvars.index(v)]
            eqn = next((e for e in body.jaxpr.eqns if v in e.outvars), None)
        if eqn is None:                  # an input (or a call passing one through)
            return None
        name = eqn.primitive.name
        return None if name in _OWN_PASS else name

    # ---- who reads the chain

    def _n_consumers(self, v) -> int:
        return len(self.uses.get(v, [])) + self.out_uses.get(v, 0)

    def _consumers_refusal(self, v, top, axis: int) -> str | None:
        """None if the chain may take the op producing ``v``
        (``_decide.forward_consumers_refusal``)."""
        def readers():
            for j, pos in self.uses.get(v, []):
                c = self.jaxpr.eqns[j]
                pat = PATTERNS.get(c.primitive.name)
                linear = (pat is not None and c.primitive.name in FORWARD
                          and sum(u is v for u in c.invars) == 1
                          and pat.input_feature_axis(c, pos) == axis
                          and not isinstance(pat.input_channel(c, pos), Refusal))
                file, line, _ = C.user_location(c) if not linear else (None, None, None)
                yield c.primitive.name, pat is not None, linear, pos, file, line
        return forward_consumers_refusal(
            self._n_consumers(v), v is top,
            f"{self.path} program" if self.out_uses.get(v, 0) else None, readers())

    # ---- activations and per-token factors

    def _ancestors(self, atom, limit: int):
        """The variables ``atom`` is computed from (itself first), depth-first; stops with a
        final ``None`` after ``limit`` equations."""
        if not isinstance(atom, C.Var):
            return
        seen, stack, n = {atom}, [atom], 0
        while stack:
            u = stack.pop()
            yield u
            prod = self.producer.get(u)
            if prod is None:
                continue
            n += 1
            if n > limit:
                yield None
                return
            for w in prod[1].invars:
                if isinstance(w, C.Var) and w not in seen:
                    seen.add(w)
                    stack.append(w)

    def cone(self, atom, limit: int = _CONE_LIMIT) -> set | None:
        """The variables ``atom`` is computed from (itself included), or None beyond
        ``limit`` equations."""
        out = set(self._ancestors(atom, limit))
        return None if None in out else out

    def _is_activation(self, operand, chain_value) -> bool:
        """Whether ``operand`` is computed from the activations: from a root's output, or
        from an ancestor of the chain value (a statistic of the token, e.g. its variance).
        Beyond the walk's bound an operand counts as a parameter: folding it stays exact
        (it is constant along every axis but the features), only computed per call."""
        if not isinstance(operand, C.Var) or operand not in self.producer and \
                operand not in self.jaxpr.invars:
            return False           # a literal or a constant
        if self.from_root(operand):
            return True
        cone = self.cone(operand)
        return cone is None or any(u in cone for u in
                                   self._ancestors(chain_value, 4 * _CONE_LIMIT))

    def _invariant(self, atom, axis: int, shape, depth: int = 0) -> bool:
        """Whether ``atom``, broadcast to ``shape``, is constant along ``axis``."""
        if isinstance(atom, C.Literal):
            return True
        s = tuple(atom.aval.shape)
        if len(s) == 0 or (len(s) == len(shape) and s[axis] == 1 and shape[axis] != 1):
            return True
        if s != tuple(shape) or depth > 16:
            return False
        e = self.producer.get(atom, (0, None))[1]
        if e is None:
            return False
        prim = e.primitive.name
        if prim == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            return axis not in dims or e.invars[0].aval.shape[dims.index(axis)] == 1
        if prim in _ELEMENTWISE:
            return all(self._invariant(u, axis, shape, depth + 1) for u in e.invars)
        return False

    def _token_split(self, e, axis: int, producer) -> list:
        """``mul(x, r)`` with ``r`` per token, or ``mul(x, r ⊗ γ)`` with ``γ`` per input
        channel: ``[(chain position, step or None, token, split variable or None)]``."""
        out = tuple(e.outvars[0].aval.shape)
        found = []
        for pos in (0, 1):
            c, o = e.invars[pos], e.invars[1 - pos]
            if not isinstance(c, C.Var) or tuple(c.aval.shape) != out or \
                    self._invariant(c, axis, out):
                continue
            if self._invariant(o, axis, out):
                found.append((pos, None, o, None))
                continue
            prod = self.producer.get(o, (0, None))[1] if isinstance(o, C.Var) else None
            if prod is None or prod.primitive.name != "mul":
                continue
            oshape = tuple(o.aval.shape)
            for q in (0, 1):
                tok, ch = prod.invars[q], prod.invars[1 - q]
                if not self._invariant(tok, axis, oshape):
                    continue
                op = resolve_operand(ch, oshape, axis, producer)
                if isinstance(op, Refusal) or self._is_activation(op.source, c):
                    continue
                found.append((pos, AffineStep(e, "mul", op), tok, o))
                break
        return found

    def _distributed_shift(self, e, axis: int, producer):
        """Keras's LayerNorm: ``x·P + (u·P + β)`` with ``P = r ⊗ γ`` and ``u = −μ`` per
        token is ``(x + u)·P + β``. Returns ``(position of x·P, step β or None, None, None,
        u, [variables computing u·P + β])``, or None."""
        out = tuple(e.outvars[0].aval.shape)
        for pos in (0, 1):
            a, b = e.invars[pos], e.invars[1 - pos]
            pa = self.producer.get(a, (0, None))[1] if isinstance(a, C.Var) else None
            if pa is None or pa.primitive.name != "mul":
                continue
            beta, dead, b_eqn = None, [b], self.producer.get(b, (0, None))[1]
            if b_eqn is not None and b_eqn.primitive.name == "add" and \
                    self._n_consumers(b) == 1:
                for q in (0, 1):
                    op = resolve_operand(b_eqn.invars[q], out, axis, producer)
                    if not isinstance(op, Refusal) and \
                            not self._is_activation(op.source, b_eqn.invars[1 - q]):
                        beta, b = AffineStep(e, "add", op), b_eqn.invars[1 - q]
                        dead.append(b)
                        break
            pb = self.producer.get(b, (0, None))[1] if isinstance(b, C.Var) else None
            if pb is None or pb.primitive.name != "mul":
                continue
            for P in set(pa.invars) & set(pb.invars):
                u = pb.invars[1 - pb.invars.index(P)]
                if isinstance(P, C.Var) and self._invariant(u, axis, out) and \
                        pa.invars.count(P) == 1 and pb.invars.count(P) == 1:
                    return (pos, beta, None, None, u, dead)
        return None
