"""Matching on StableHLO: the chain after a root.

Roots and operands are read by ``_fold.stablehlo.patterns``. :class:`ChainWalker` (the matching half of
the pass in ``_fold.stablehlo.fold``) holds what the walk needs across sites; the pass follows a
root's result with the one chain walk of both paths (``_fold.core.chain.walk``) over
:class:`HloChain`, whose rule table :data:`HLO_STEPS` says what each op does: per-channel
arithmetic, ``batch_norm_inference``, the shape ops of the shared rule
``_base.chain_rules.pass_axis``, private callees (inlined on trial). It also accounts for
normalizations no root reaches.
"""
from __future__ import annotations

from hlofold import _compat as C
from hlofold._ir.stablehlo import ops
from hlofold._fold.core.chain import AGAIN, Absorb, Pass, postorder
from hlofold._base.chain_rules import DIVISOR, Refusal, pass_axis
from hlofold._ir.stablehlo.facts import forget_op_facts
from hlofold._ir.stablehlo.build import GUARD, STACK, marked
from hlofold._ir.stablehlo.ir import (BINARY, ROOTS, SHAPE_KIND, attr_dims, elem_type, float_dtype,
                                      is_float, location, op_name, owner_op, readers, reads,
                                      remap_operands, shape_of)
from .patterns import Step, axis_role, resolve
from hlofold._base.report import NOT_REACHED, FoldSite
from hlofold._fold.core.unreached import unreached_reason

ir, stablehlo, func_dialect = C.mlir()


# the ops the unreached accounting looks at
# (a normalization starts at an inference BatchNorm or a product)
UNREACHED_OPS = ops.names(lambda o: o.affine in ("bn", "mul"))


class ChainWalker:
    """What the StableHLO pass (``_fold.stablehlo.fold._Pass``) keeps for its chain walks: private calls
    inlined on trial, the values' lineage (sources, activation), and the records of unreached
    normalizations."""

    def _account_unreached(self, fop, fname, ops=None, dead=frozenset()) -> None:
        """A NOT_REACHED record for each ``batch_norm_inference`` and each ``multiply`` of
        an activation by a per-channel vector of parameters that no root's chain took (the
        rule of :mod:`hlofold._fold.core.unreached`, as on the jaxpr path). ``ops``: the function's
        ops named in :data:`UNREACHED_OPS` in program order (None: read them from it);
        ``dead``: ops a fold replaced."""
        if ops is None:
            ops = [op.operation for op in fop.regions[0].blocks[0].operations
                   if op.operation.name in UNREACHED_OPS]
        for op in ops:
            name = op.name
            if op in dead or op in self.forward_taken:   # a chain's, a forward chain's
                continue
            if name == "stablehlo.batch_norm_inference":
                x = op.operands[0]
                size = shape_of(x)[ir.IntegerAttr(op.attributes["feature_index"]).value]
            elif len(shape_of(op.results[0])) >= 2:           # a multiply
                acts = [v for v in op.operands if self._from_root(v)]
                if len(acts) != 1:
                    continue
                x = acts[0]
                other = op.operands[1] if x == op.operands[0] else op.operands[0]
                shape = shape_of(op.results[0])
                found = next((r for r in (resolve(other, shape, a, explain=False)
                                          for a in range(len(shape))
                                          if shape[a] != 1)
                              if not isinstance(r, Refusal) and r.size > 1), None)
                if found is None or self._from_root(found.value):
                    continue
                size = found.size
            else:
                continue
            after = self._before_chain(x)
            if after is None or not self._from_root(x):
                continue                 # a root's record accounts for it
            then = self._after_chain(op.results[0])
            file, line, lname = location(op)
            self.sites.append(FoldSite(
                pattern="unreached_affine", primitive=name, status=NOT_REACHED,
                scope=f"@{fname}", file=file, line=line, name_stack=lname,
                dtype=str(elem_type(op.results[0])), out_channels=int(size),
                reason=unreached_reason(after, then)))

    def _after_chain(self, value) -> str | tuple[str, ...]:
        """Where ``value`` goes past the per-channel arithmetic and shape ops after it (a
        norm's own ``+ β``, a reshape): "output", or the ops reading it there."""
        for _ in range(10_000):
            users = [u.owner for u in value.uses]
            if not users or any(op_name(u) == "func.return" for u in users):
                return "output"
            if len(users) == 1:
                op, name = users[0], op_name(users[0])
                acts = [v for v in op.operands if self._from_root(v)]
                if (len(acts) == 1 and len(op.results) == 1 and
                        (name in BINARY or name in SHAPE_KIND)):
                    value = op.results[0]
                    continue
            return tuple(op_name(u).split(".")[-1] for u in users)
        return "output"     # pragma: no cover

    def _before_chain(self, value) -> str | None:
        """The op before the per-channel arithmetic and shape ops leading to ``value``
        ("input" at a function argument); None when that is a root."""
        for _ in range(10_000):
            op = owner_op(value)
            if op is None:
                return "input"
            name = op_name(op)
            if name in ROOTS:
                return None
            acts = [v for v in op.operands if self._from_root(v)]
            if len(acts) == 1 and (name in BINARY or name in SHAPE_KIND):   # arithmetic, shape ops, casts
                value = acts[0]
                continue
            return name.split(".")[-1]
        return "input"     # pragma: no cover

    # -- chain walk

    def _inline_call(self, call, arg_index) -> str | None:
        """Inline a private callee into the caller when the chain continues in it; else say
        why the chain ends at the call."""
        callee_name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        callee = self.symbols.get(callee_name)
        if callee is None or not callee.regions[0].blocks or \
                "sym_visibility" not in callee.attributes or \
                ir.StringAttr(callee.attributes["sym_visibility"]).value != "private":
            return f"chain continues into @{callee_name}, which is not a private function"
        body = callee.regions[0].blocks[0]
        arg = body.arguments[arg_index]
        uses = list(arg.uses)
        if len(uses) != 1 or op_name(uses[0].owner) not in (*BINARY, "stablehlo.negate",
                                                          "stablehlo.convert",
                                                          "stablehlo.batch_norm_inference"):
            first = op_name(uses[0].owner) if uses else "nothing"
            return f"chain ends at call @{callee_name} (its argument feeds {first})"
        mapping = {}
        for a, v in zip(body.arguments, call.operands):
            mapping[a] = v
        ret, cloned = None, []
        with ir.InsertionPoint(call):
            for op in body.operations:
                if op_name(op) == "func.return":
                    ret = op
                    break
                new = op.clone()
                cloned.append(new)
                remap_operands(new, mapping)
                for old_r, new_r in zip(op.results, new.results):
                    mapping[old_r] = new_r
        # a trial: the call stays (its uses moved to the inlined ops) until the site is
        # decided; refused, the call gets its uses back and the inlined ops go (the module
        # is changed only for a chain that folds)
        results = [next((dst for src, dst in mapping.items() if src == v), v)
                   for v in ret.operands]
        for r, v in zip(call.results, results):
            r.replace_all_uses_with(v)
        self.trial.append((call, callee_name, cloned, results))
        return None

    def _end_trial(self, folded: bool) -> bool:
        """Keep (``folded``) or undo the private calls a site's walk inlined; whether the
        program now holds inlined ops."""
        if not self.trial:
            return False
        lineage = self.lineage   # (keyed by value addresses: an erased op's go with it; the
        #                          others hold: the program as written, or inlined ops kept)
        for call, callee_name, cloned, results in reversed(self.trial):
            if folded:
                sites = self.eval.calls.get(callee_name, [])
                sites[:] = [c for c in sites if c.operation != call.operation]
                for r in call.results:
                    lineage.pop(r, None)
                call.erase()
                self.inlined.add(callee_name)
                continue
            for r, v in zip(call.results, results):
                v.replace_all_uses_with(r)
            for op in reversed(cloned):
                for r in op.results:
                    lineage.pop(r, None)
                op.erase()
        self.trial.clear()
        forget_op_facts()          # the other memos, keyed by addresses, are simply dropped
        self.invariant_memo.clear()
        self.reads_memo.clear()
        self.forward_memo.clear()
        self.chain_shared.clear()
        self.shape_memo.clear()
        self.eval.memo.clear()
        return folded

    def _reads_of(self, op) -> list:
        """The values ``op`` reads, inside its regions too (:func:`reads`); cached for an op
        with regions (the reads inside them are a walk), read again for one without."""
        if not len(op.regions):
            return op.operands
        got = self.reads_memo.get(op)
        if got is None:
            got = self.reads_memo[op] = reads(op)
        return got

    def _sweep(self, holder, roots: list | None = None, keep=(), kept: list | None = None,
               guarded: bool = False) -> None:
        """Fill the lineage of every value in ``holder``'s regions (:meth:`_lineage`), in
        program order: each op once, after its producers (SSA) and after the ops in its own
        regions. What the sweep does not see (an op added later) :meth:`_lineage` walks when
        asked. The same walk collects, in ``roots``, the roots (convolutions, dots) in
        ``holder``'s regions, nested regions included (a multi-platform export puts its
        program in a ``stablehlo.case``'s branches) but not in hlofold's own guards, and in
        ``kept`` the ops directly in them named in ``keep``."""
        collect = roots is not None and not guarded
        settle = self._settle
        for region in holder.regions:
            for block in region.blocks:
                for op in block.operations:
                    op = op.operation
                    name = op.name
                    root = name in ROOTS
                    if collect:
                        if root:
                            roots.append(op)
                        elif name in keep:        # (names of ops hlofold never marks)
                            kept.append(op)
                    if len(op.regions):              # (nesting, not operands)
                        self._sweep(op, None if marked(op, STACK) else roots,
                                    guarded=guarded or marked(op, GUARD))
                        settle(op, self._reads_of(op), root)
                    else:
                        settle(op, op.operands, root)

    def _settle(self, op, reads, root: bool) -> None:
        """The lineage of ``op``'s results: what the values it reads (``reads``) are computed
        from, and bit 0 for a root (the one rule of the sweep and of the lazy walk)."""
        lineage = self.lineage
        out = 1 if root else 0
        for v in reads:
            got = lineage.get(v)
            out |= self._lineage(v) if got is None else got    # (a block argument's first read)
        for r in op.results:
            lineage[r] = out

    def _lineage(self, value) -> int:
        """The block arguments ``value`` is computed from (bits from bit 1 on; an argument's
        own bit is given at its first read; one whose value is bound, none) and whether from a root's output (bit 0): the
        sweep's, or walked iteratively for a value added since (each value once, through the
        ops' region reads too)."""
        lineage = self.lineage
        got = lineage.get(value)
        if got is not None:
            return got
        if isinstance(value, ir.BlockArgument):
            if value in self.eval.bound:     # (a known weight, as a constant: links nothing —
                got = lineage[value] = 0     # an unrolled scan's layers read one stack)
                return got
            got = lineage[value] = 2 << self.n_args
            self.n_args += 1
            return got

        def inputs_of(v):
            return () if isinstance(v, ir.BlockArgument) else \
                self._reads_of(v.owner.operation)

        def settle(v):
            if isinstance(v, ir.BlockArgument):
                self._lineage(v)
            else:
                op = v.owner.operation
                self._settle(op, self._reads_of(op), op.name in ROOTS)
        return postorder(value, lineage, inputs_of, settle)

    def _from_root(self, value) -> bool:
        """Whether ``value`` is computed from a conv/dot result (an activation), also through
        ops whose regions read one (a site's run-time guard): bit 0 of its lineage. No op is
        erased while the lineage is in use (see ``dead``)."""
        return bool(self._lineage(value) & 1)


class HloChain:
    """The StableHLO adapter of the chain walk (``_fold.core.chain.ChainIR``), for one root; what each
    op does to the chain is the rule table :data:`HLO_STEPS`."""

    def __init__(self, walker: ChainWalker, root, fname: str):
        self.walker, self.root = walker, root
        self.program = f"function @{fname}"

    def uses(self, v):
        trial = self.walker.trial
        if trial:
            pending = {c for c, *_ in trial}               # inlined: their uses moved
            got = readers(v, lambda op: op in pending)
        else:
            got = readers(v)
        users, n_out = [], 0
        for owner, pos in got:
            if op_name(owner) == "func.return":
                n_out += 1
            else:
                users.append((owner, pos))
        return users, n_out

    def name(self, op) -> str:
        return op_name(op)

    def result(self, op):
        return op.results[0]

    def describe(self, v) -> str:
        return str(v.type)

    def step(self, op, pos, v, axis):
        rule = HLO_STEPS.get(op_name(op))
        return rule(self, op, pos, v, axis) if rule else f"chain ends at {op_name(op)}"

    def peek(self, op, pos, v, axis):
        rule = HLO_STEPS.get(op_name(op))
        if rule is _branch_return:     # a branch's result: an output, as on a jaxpr
            return "end"
        return None if rule is _call else rule(self, op, pos, v, axis) if rule else "end"

    def from_root(self, v) -> bool:
        return owner_op(v) is not None and self.walker._from_root(v)

    def joins_activation(self, op, pos, v) -> bool:
        return any(self.walker.is_activation(o, v) for k, o in enumerate(op.operands)
                   if k != pos)

    def explain_axis(self, axis: int) -> str:
        return axis_role(self.root, axis)


def _binary(chain: HloChain, op, pos, v, axis):
    name, kind = op_name(op), BINARY[op_name(op)]
    if kind == "sub":
        kind = "sub" if pos == 0 else "rsub"
    elif kind == "div" and pos != 0:
        return Refusal(DIVISOR.after(f"{name} "))
    # (chain None: the forward walk, which asks only whether the step is one)
    got = resolve(op.operands[1 - pos], shape_of(v), axis, explain=chain is not None)
    if isinstance(got, Refusal):
        return got if chain is None else Refusal(got.reason.after(f"{name}: "), got.axis)
    return Absorb(Step(op, kind, got, axis=axis), got.value)


def _negate(chain: HloChain, op, pos, v, axis):
    return Absorb(Step(op, "neg", axis=axis))


def _shape(chain: HloChain, op, pos, v, axis):
    name = op_name(op)
    nxt = pass_axis(SHAPE_KIND[name], shape_of(v), shape_of(op.results[0]), axis,
                    floats=is_float(v) and is_float(op.results[0]),
                    perm=attr_dims(op, "permutation"),
                    bdims=attr_dims(op, "broadcast_dimensions"))
    if isinstance(nxt, Refusal):
        return nxt.reason.after(f"{name}: ")
    convert = SHAPE_KIND[name] == "convert"
    return Pass(Step(op, "convert" if convert else "shape", axis=nxt), nxt,
                (float_dtype(elem_type(v)), float_dtype(elem_type(op.results[0])))
                if convert else None)


def _batch_norm(chain: HloChain, op, pos, v, axis):
    if pos != 0:
        return "chain ends at stablehlo.batch_norm_inference"
    fi = ir.IntegerAttr(op.attributes["feature_index"]).value
    if fi != axis:
        same = " (same size: matched by dimension, not size)" if \
            shape_of(v)[fi] == shape_of(v)[axis] else ""
        return Refusal(f"batch_norm_inference feature_index {fi} is not the output-feature "
                       f"dimension {axis}{same}")
    bn = {k: op.operands[i] for i, k in enumerate(["x", "scale", "offset", "mean", "variance"])}
    bn["epsilon"] = ir.FloatAttr(op.attributes["epsilon"]).value
    return Absorb(Step(op, "bn", bn=bn, axis=axis))


def _call(chain: HloChain, op, pos, v, axis):
    why = chain.walker._inline_call(op, pos)
    return AGAIN if why is None else why


def _branch_return(chain: HloChain, op, pos, v, axis):
    if op_name(op.parent) not in ("stablehlo.case", "stablehlo.if"):
        return "chain ends at stablehlo.return"
    return (f"the root is inside a {op_name(op.parent)} branch whose branches differ (a "
            "case with the same branches, as a multi-platform export lowers each convolution, "
            "is inlined first); not followed out of the branch — export for one platform, or "
            "fold before exporting (hlofold.export)")


# what each op does to a chain that reaches it (others end the chain)
HLO_STEPS = {
    **{name: _binary for name in BINARY},
    **{name: _shape for name in SHAPE_KIND},
    "stablehlo.negate": _negate,
    "stablehlo.batch_norm_inference": _batch_norm,
    "func.call": _call,
    "stablehlo.return": _branch_return,
}
