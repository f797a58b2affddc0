"""Planning a forward fold on a jaxpr: the affine chain *in front of* a root.

``root(x·s + t, K) = root(x, K ⊙_in s) + root(t, K)`` for ``s``/``t`` per input feature. The
chain is the shared walk ``_fold.core.forward_walk.walk_forward`` (per-input-channel steps, LayerNorm's
and RMSNorm's per-token factors kept in the graph as :attr:`Forward.tokens`) over
:class:`JaxprForwardIR`; here are the jaxpr's answers to its questions (who reads a value,
what is computed from the activations, what is per token) and the site's record.

A normalized value read by several roots (Q/K/V, gate/up) folds into each of them when every
consumer is a linear root reading it as its input features; any other consumer refuses them
all, naming it. An operand that shares an ancestor with the chain value is computed from the
activations (a statistic of the token), never a parameter.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._base.algebra import has_shift
from hlofold._base.chain_rules import Block, Refusal
from hlofold._base.channel_axes import back_through_shape
from .steps import AFFINE_STEPS, AffineStep, affine_step, resolve_operand
from hlofold._fold.core.decide import forward_consumers_refusal, forward_note, multi_output_shift
from hlofold._fold.core.forward_walk import PASS, walk_forward
from .patterns import FORWARD, PATTERNS, RootInfo
from hlofold._base.report import FOLDED, REFUSED, FoldSite
from hlofold._base.reasons import Reason
from hlofold._fold.core.rules import bias_map_refusal

# producers an elementwise consumer is not fused into: the affine in front is a pass of its own
_OWN_PASS = ops.names(lambda o: o.opaque)
_CALLS = ops.names(lambda o: o.call in ("jit", "custom"))
_ELEMENTWISE = ops.names(lambda o: o.elementwise)
# (the same values: the root reads them constrained, or named (checkpoint_name), again)
_PASS = ops.names(lambda o: o.shape in ("constraint", "copy"))
# shape ops a forward chain passes next to the root where they keep the channels whole
_MOVES = ops.OPS.kinds("shape", {k: k for k in ("reshape", "squeeze", "expand", "broadcast")})


def elems(shape, skip: int | None = None) -> int:
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
    passes: list = dataclasses.field(default_factory=list)   # sharding constraints replayed
    # per spatial dimension, which taps read the input (padding, lhs dilation): the shift
    # then adds a bias map ``conv(pad(t), K)`` (``ConvAffinePattern.border_masks``)
    masks: list | None = None
    s_known: np.ndarray | None = None
    t_known: np.ndarray | None = None

    @property
    def has_shift(self) -> bool:
        return has_shift(self.steps)


class ForwardPlanner:
    """The forward-chain half of :class:`hlofold._fold.jaxpr.plan.SitePlanner`."""

    def _plan_forward(self, eqn, pattern, info: RootInfo) -> Forward | None:
        """Follow the root's lhs back through per-input-channel affine ops
        (``_fold.core.forward_walk.walk_forward``). Returns the forward fold, or None (no chain, or
        refused: then recorded)."""
        act = 1 - info.kernel_index          # the operand holding the activations
        axis = pattern.input_feature_axis(eqn, act)
        if axis is None:
            return None
        top = eqn.invars[act]
        chain = walk_forward(self._forward_ir, top, axis)
        if isinstance(chain, Reason):
            return self._no_forward(eqn, info, chain)
        v, steps, tokens, reason = chain.source, chain.steps, chain.tokens, chain.stop
        taken = [self.producer[e.outvars[0]][0] for e in chain.taken]
        self.forward_taken.update(taken)
        if not steps:
            return self._no_forward(eqn, info, reason)
        fpat = FORWARD[eqn.primitive.name]
        names = sorted({n for s in steps if s.operand is not None
                        for n in self.names(s.operand.source) if n})
        ic = pattern.input_channel(eqn, act)
        absorbed = [s.eqn.primitive.name for s in steps]
        masks = pattern.border_masks(eqn) if has_shift(steps) else None
        why = next((r.reason for r in (ic, masks) if isinstance(r, Refusal)), None) or \
            multi_output_shift(has_shift(steps), pattern.output_dims(eqn, info.kernel_index),
                               isinstance(info.kernel_axis, Block))
        if why is None and masks is not None:
            why = bias_map_refusal(elems(eqn.outvars[0].aval.shape, pattern.batch_axis(eqn)),
                                   elems(v.aval.shape), self._fused_with(v))
        if why:
            self._record(eqn, fpat, info, REFUSED, absorbed=absorbed, params=names,
                         reason=why)
            return None
        rec = self._record(eqn, fpat, info, FOLDED, absorbed=absorbed, params=names)
        rec.note = forward_note(len(tokens), self._n_consumers(top), masks is not None, reason)
        return Forward(steps, v, ic[1], info.groups, rec, tokens=tokens, act=act,
                       masks=masks, passes=chain.passes)

    @functools.cached_property
    def _forward_ir(self) -> "JaxprForwardIR":
        """The scope's forward-walk adapter (it reads the scope's tables when asked: one per
        scope, not one per root)."""
        return JaxprForwardIR(self)

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
        """Equations reading ``v`` (one reading it twice, ``mul(x, x)``, counts once) and
        program outputs returning it."""
        return len({j for j, _ in self.uses.get(v, [])}) + self.out_uses.get(v, 0)

    def _consumers_refusal(self, v, top, axis: int) -> str | None:
        """None if the chain may take the op producing ``v``
        (``_fold.core.decide.forward_consumers_refusal``)."""
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

    def cone(self, atom, limit: int) -> set | None:
        """The variables ``atom`` is computed from (itself included), or None beyond
        ``limit`` equations: a local pattern question (what a weight's few producers are),
        never one of reachability."""
        if not isinstance(atom, C.Var):
            return set()
        seen, stack, n = {atom}, [atom], 0
        while stack:
            prod = self.producer.get(stack.pop())
            if prod is None:
                continue
            n += 1
            if n > limit:
                return None
            for w in prod[1].invars:
                if isinstance(w, C.Var) and w not in seen:
                    seen.add(w)
                    stack.append(w)
        return seen

    def is_activation(self, operand, chain_value) -> bool:
        """Whether ``operand`` is computed from the activations: from a root's output, or
        from a program input the chain value is computed from too (a statistic of the
        token, e.g. its variance). Constants link nothing. No bound: two sweeps over the
        program (``from_root``, ``sources``), each equation once."""
        if not isinstance(operand, C.Var) or operand not in self.producer and \
                operand not in self.jaxpr.invars:
            return False           # a literal or a constant
        if self.from_root(operand):
            return True
        return bool(self.sources(operand) & self.sources(chain_value))


class JaxprForwardIR:
    """The jaxpr adapter of the forward walk (``_fold.core.forward_walk.ForwardIR``), for one scope
    (a jaxpr has no regions: the walk's questions do not depend on the root)."""

    def __init__(self, planner: ForwardPlanner):
        self.p = planner
        self.get = lambda u: planner.producer.get(u, (0, None))[1]
        self.invariant_memo: dict = {}

    def producer(self, value):
        return self.get(value) if isinstance(value, C.Var) else None

    def takeable(self, e) -> bool:
        name = e.primitive.name
        return (name in AFFINE_STEPS or name in _PASS or name in _MOVES) and \
            self.p.producer[e.outvars[0]][0] not in self.p.claimed

    def pass_axis(self, e, axis: int):
        name = e.primitive.name
        if name in _PASS:
            return axis
        src = e.invars[0] if name in _MOVES else None
        if not isinstance(src, C.Var):
            return None
        dims = e.params.get("broadcast_dimensions") if _MOVES[name] == "broadcast" else None
        return back_through_shape(_MOVES[name], src.aval.shape, e.outvars[0].aval.shape,
                                  axis, dims)

    def kind(self, e) -> str:
        name = e.primitive.name
        if name in _PASS:
            return PASS
        if name in AFFINE_STEPS or name == "broadcast_in_dim":
            return name
        return "elementwise" if name in _ELEMENTWISE else "other"

    def operands(self, e) -> list:
        return e.invars

    def result(self, e):
        return e.outvars[0]

    def shape(self, value):
        return None if isinstance(value, C.Literal) else tuple(value.aval.shape)

    def broadcast_dims(self, e) -> tuple:
        return tuple(e.params["broadcast_dimensions"])

    def affine(self, e, pos: int, axis: int):
        if e.primitive.name not in AFFINE_STEPS:     # (a shape op pass_axis did not pass)
            return None
        r = affine_step(e, pos, axis, self.get)
        if not isinstance(r, AffineStep):
            return None
        return r, (r.operand.source if r.operand is not None else None)

    def channel(self, value, shape, axis: int):
        op = resolve_operand(value, shape, axis, self.get)
        return None if isinstance(op, Refusal) else (op, op.source)

    def step(self, e, kind: str, operand, axis: int):
        return AffineStep(e, kind, operand)

    def known(self, value) -> bool:
        return self.p.value(value) is not None

    def is_activation(self, source, chain_value) -> bool:
        return self.p.is_activation(source, chain_value)

    def consumers_refusal(self, value, top, axis: int):
        return self.p._consumers_refusal(value, top, axis)

    def n_consumers(self, value) -> int:
        return self.p._n_consumers(value)
