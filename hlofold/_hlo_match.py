"""Matching on StableHLO: the chain after a root.

Roots and operands are read by ``_hlo_patterns``. :class:`ChainWalker` (the matching half of
the pass in ``_stablehlo``) follows a root's result through per-channel arithmetic,
``batch_norm_inference`` and the shape ops of the shared rule ``_chain_rules.pass_axis``,
into private callees (inlined on trial), and accounts for normalizations no root reaches.
"""
from __future__ import annotations

from . import _compat as C
from ._chain_rules import DIVISOR, FROM_ACTIVATION, Refusal, pass_axis
from ._hlo_ir import (BINARY, ROOTS, SHAPE_KIND, attr_dims, elem_type, is_float, location,
                      op_name, owner_op, reads, remap_operands, shape_of)
from ._hlo_patterns import Step, axis_role, resolve
from ._report import NOT_REACHED, FoldSite
from ._unreached import unreached_reason

ir, stablehlo, func_dialect = C.mlir()


class ChainWalker:
    """The chain walk of the StableHLO pass (``_stablehlo._Pass``)."""

    def _account_unreached(self, fop, fname) -> None:
        """A NOT_REACHED record for each ``batch_norm_inference`` and each ``multiply`` of
        an activation by a per-channel vector of parameters that no root's chain took (the
        rule of :mod:`hlofold._unreached`, as on the jaxpr path)."""
        for op in list(fop.regions[0].blocks[0].operations):
            name = op_name(op)
            if name == "stablehlo.batch_norm_inference":
                x = op.operands[0]
                size = shape_of(x)[ir.IntegerAttr(op.attributes["feature_index"]).value]
            elif name == "stablehlo.multiply" and len(shape_of(op.results[0])) >= 2:
                acts = [v for v in op.operands if self._from_root(v)]
                if len(acts) != 1:
                    continue
                x = acts[0]
                other = op.operands[1] if x == op.operands[0] else op.operands[0]
                shape = shape_of(op.results[0])
                found = next((r for r in (resolve(other, shape, a) for a in range(len(shape))
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
            uses = list(op.results[0].uses)
            then = ("output" if not uses or op_name(uses[0].owner) == "func.return" else
                    op_name(uses[0].owner).split(".")[-1])
            file, line, lname = location(op)
            self.sites.append(FoldSite(
                pattern="unreached_affine", primitive=name, status=NOT_REACHED,
                scope=f"@{fname}", file=file, line=line, name_stack=lname,
                dtype=str(elem_type(op.results[0])), out_channels=int(size),
                reason=unreached_reason(after, then)))

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

    def _end_trial(self, folded: bool) -> None:
        """Keep (``folded``) or undo the private calls a site's walk inlined."""
        if not self.trial:
            return
        for call, callee_name, cloned, results in reversed(self.trial):
            if folded:
                call.erase()
                self.inlined.add(callee_name)
                continue
            for r, v in zip(call.results, results):
                v.replace_all_uses_with(r)
            for op in reversed(cloned):
                op.erase()
        self.trial.clear()
        self.activation.clear()    # keyed by op addresses: drop them after erasing
        self.eval.memo.clear()

    def _walk(self, root, axis):
        v = root.results[0]
        steps, committed, stop, refusal = [], 0, None, False
        while True:
            pending = {c for c, *_ in self.trial}      # inlined: their uses moved
            uses = [u for u in v.uses if u.owner not in pending]
            if len(uses) != 1:
                if len(uses) > 1:
                    stop = f"a value in the chain has {len(uses)} consumers"
                    refusal = True
                else:
                    stop = "value is unused"
                break
            user, pos = uses[0].owner, uses[0].operand_number
            name = op_name(user)
            if name == "func.return":
                stop = "value is returned"
                break
            if name == "stablehlo.return" and op_name(user.parent) in ("stablehlo.case",
                                                                      "stablehlo.if"):
                stop = (f"the root is inside a {op_name(user.parent)} branch (a multi-platform "
                        "export lowers each convolution per platform); not followed out of "
                        "the branch — export for one platform, or fold before exporting "
                        "(hlofold.export)")
                break
            if name == "func.call":
                why = self._inline_call(user, pos)
                if why is None:
                    continue
                stop = why
                break
            if name in BINARY:
                kind = {"add": "add", "mul": "mul"}.get(BINARY[name])
                if BINARY[name] == "sub":
                    kind = "sub" if pos == 0 else "rsub"
                elif BINARY[name] == "div":
                    kind = "div" if pos == 0 else None
                if kind is None:
                    stop, refusal = f"{name} {DIVISOR}", True
                    break
                op = resolve(user.operands[1 - pos], shape_of(v), axis)
                if isinstance(op, Refusal):
                    stop, refusal = f"{name}: {op.reason}", True
                    if op.axis is not None and v == root.results[0]:
                        stop += f"; axis {op.axis} is {axis_role(root, op.axis)}"
                    break
                if owner_op(op.value) is not None and self._from_root(op.value):
                    stop, refusal = f"{name}: {FROM_ACTIVATION}", True
                    break
                steps.append(Step(user, kind, op, axis=axis))
                committed = len(steps)
            elif name == "stablehlo.negate":
                steps.append(Step(user, "neg", axis=axis))
                committed = len(steps)
            elif name in SHAPE_KIND:
                nxt = pass_axis(SHAPE_KIND[name], shape_of(v), shape_of(user.results[0]), axis,
                                floats=is_float(v) and is_float(user.results[0]),
                                perm=attr_dims(user, "permutation"),
                                bdims=attr_dims(user, "broadcast_dimensions"))
                if isinstance(nxt, Refusal):
                    stop = f"{name}: {nxt.reason}"
                    break
                steps.append(Step(user, "convert" if SHAPE_KIND[name] == "convert"
                                   else "shape", axis=nxt))
                axis = nxt
            elif name == "stablehlo.batch_norm_inference" and pos == 0:
                fi = ir.IntegerAttr(user.attributes["feature_index"]).value
                if fi != axis:
                    stop = (f"batch_norm_inference feature_index {fi} is not the output-feature "
                            f"dimension {axis}" + (" (same size: matched by dimension, not "
                                                   "size)" if shape_of(v)[fi] == shape_of(v)[axis]
                                                   else ""))
                    refusal = True
                    break
                eps = ir.FloatAttr(user.attributes["epsilon"]).value
                bn = {k: user.operands[i] for i, k in enumerate(
                    ["x", "scale", "offset", "mean", "variance"])}
                bn["epsilon"] = eps
                steps.append(Step(user, "bn", bn=bn, axis=axis))
                committed = len(steps)
            else:
                stop = f"chain ends at {name}"
                break
            v = user.results[0]
        return steps[:committed], stop, refusal

    def _from_root(self, value) -> bool:
        """Whether ``value`` is computed from a conv/dot result (an activation), also through
        ops whose regions read one (a site's run-time guard). Memoized per op (no op is
        erased while the memo is in use: see ``dead``): one walk over the program in all,
        not one per operand."""
        top = owner_op(value)
        if top is None:
            return False
        memo = self.activation
        stack = [top]
        while stack:
            op = stack[-1]
            if op in memo:
                stack.pop()
                continue
            if op_name(op) in ROOTS:
                memo[op] = True
                stack.pop()
                continue
            producers = [p for p in (owner_op(v) for v in reads(op)) if p is not None]
            missing = [p for p in producers if p not in memo]
            if missing:
                stack.extend(missing)
                continue
            memo[op] = any(memo[p] for p in producers)
            stack.pop()
        return memo[top]

