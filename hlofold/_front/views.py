"""What a :class:`~hlofold._front.api.Folded` shows besides calling it: reports, jaxprs, the
lowered program, precision measurements, and the prepare/apply :class:`Split`.

:class:`FoldedViews` is the inspection half of ``Folded`` (a mixin: it reads the program
cache and the folding helpers of ``_api.Folded``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from hlofold import _compat as C
from hlofold._base.report import FoldReport
from .tune import chosen_options


@dataclasses.dataclass
class Split:
    """The folded program split in two, for the parameter values it was made with.

    ``prepare(*args, **kw)`` folds the parameter inputs listed in ``prepared_from`` (on the
    host, see :mod:`hlofold._front.prepare`) and returns the arrays the per-call part needs
    (folded kernels, biases, unfolded parameters); ``apply(prepared, *args, **kw)`` runs the
    per-call part, reading only the inputs listed in ``per_call`` (pass the same pytree
    structure; the values of the others are ignored). ``apply`` can be called under your own
    ``jax.jit``. ``prepare`` runs outside it and raises ``ValueError`` for parameter values
    that fold differently (e.g. a BatchNorm scale that is not finite refuses its site).
    """

    prepared_from: list[str]
    per_call: list[str]
    apply_jaxpr: C.ClosedJaxpr          # inputs: (*prepared, *per-call leaves)
    report: FoldReport
    _folded: Any                        # the Folded it came from
    _key: Any
    _folding: Any
    _fn: Callable

    def prepare(self, *args, **kwargs) -> list[jax.Array]:
        if self._key is None:           # folding is off on this JAX: nothing to prepare
            return []
        prog, leaves = self._folded._program_for(args, kwargs)
        self._check(prog)
        known = [leaves[i] for i in prog.known_idx]
        if any(C.is_tracer(k) for k in known):
            raise ValueError("hlofold: Split.prepare needs concrete parameters: call it "
                             "outside jax.jit (and pass its result into your jitted apply)")
        folding, _, prepared = self._folded._folding_for(prog, known)
        if folding is not self._folding and folding.structure != self._folding.structure:
            why = _first_difference(self._folding.report, folding.report)
            raise ValueError(f"hlofold: these parameters fold differently from the ones the "
                             f"split was made with ({why}); make a new split for them")
        return list(prepared)

    def apply(self, prepared: Sequence[jax.Array], *args, **kwargs):
        if self._key is None:           # folding is off on this JAX: the original program
            return self._fn(*args, **kwargs)
        prog, leaves = self._folded._program_for(args, kwargs)
        self._check(prog)
        ins = [*prepared, *[leaves[i] for i in prog.unknown_idx]]
        # under the user's jit: the program inlined (a nested jit takes no compile options)
        fn = getattr(self._fn, "__wrapped__", self._fn) if any(map(C.is_tracer, ins)) \
            else self._fn
        outs = fn(*ins)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def _check(self, prog):
        if prog.key != self._key:
            raise ValueError("hlofold: Split.prepare/apply called with inputs of another "
                             "signature than the one the split was made for")


def _first_difference(a: FoldReport, b: FoldReport) -> str:
    for x, y in zip(a.sites, b.sites):
        if (x.status, x.reason) != (y.status, y.reason):
            return f"{y.pattern} at {y.location}: {y.status}" + (f": {y.reason}"
                                                                  if y.reason else "")
    return "the folded program differs"


class FoldedViews:
    """Inspection methods of ``Folded`` (see the module docstring)."""

    def _folding_of(self, args, kwargs):
        """(program, Folding for these arguments' parameter values, or None if traced)."""
        prog, leaves = self._program_for(args, kwargs)
        known = [leaves[i] for i in prog.known_idx]
        if any(C.is_tracer(k) or not hasattr(k, "__array__") for k in known):
            return prog, None
        return prog, self._folding_for(prog, known, count=False)[0]

    def report(self, *args, **kwargs) -> FoldReport:
        """The fold report for these arguments (direct calls). With abstract parameters
        (e.g. ``jax.ShapeDtypeStruct``) it says what would be prepared, without values."""
        try:
            prog, rep = self._report_of(args, kwargs)
        except C.CompatError as e:     # this JAX changed what folding reads: nothing folds
            return FoldReport([], running=f"the original program ({e})", compat=[str(e)])
        why = prog.running()
        return rep if why is None else dataclasses.replace(rep, running=why)

    def _report_of(self, args, kwargs) -> tuple[Any, FoldReport]:
        prog, folding = self._folding_of(args, kwargs)
        return prog, (self._variant(prog, "prepared")[1] if folding is None
                      else folding.report)

    def traced_report(self, *args, **kwargs) -> FoldReport:
        """What a call under an enclosing transformation (``jax.jit(folded)``) folds, for
        inputs of this signature: sites whose parameters would be traced there are reported
        unfolded with the reason (``in_graph=False``) or guarded in the graph (``True``)."""
        if self._off is not None:
            return self.report(*args, **kwargs)
        return self._variant(self._program_for(args, kwargs)[0], self._traced_mode())[1]

    def measure_precision(self, *args, **kwargs) -> dict:
        """Error of the unfolded and the folded program against a float32 reference of the
        same network (every bf16/fp16 value carried in float32), on these inputs. The figures
        are also stored in ``report(*args).precision``."""
        from .precision import measure
        prog, leaves = self._program_for(args, kwargs)
        result = measure(prog.original, lambda *l: self._call_leaves(prog, list(l))[0], leaves)
        self._report_of(args, kwargs)[1].precision = result
        return result

    def jaxpr(self, *args, **kwargs) -> C.ClosedJaxpr:
        """The program calls with these arguments run, as a jaxpr: the folded kernels and
        biases prepared from these parameter values are its constants, and its inputs are
        the per-call inputs only (the flattened non-static, non-frozen arguments a folded
        site does not read: ``split(...).per_call``). The parameters it was prepared from
        are not inputs, so it cannot be run with other values by mistake; for other
        parameter values ask again (or use :meth:`split`). With traced or abstract
        parameters, the program a call under an enclosing transformation runs (its inputs:
        every non-static, non-frozen leaf)."""
        if self._off is not None:         # this JAX switched folding off: the original
            return self.original_jaxpr(*args, **kwargs)
        prog, folding = self._folding_of(args, kwargs)
        if folding is None:
            return self._variant(prog, self._traced_mode())[0]
        return folding.folded

    def original_jaxpr(self, *args, **kwargs) -> C.ClosedJaxpr:
        """The jaxpr before folding."""
        if self._off is not None:
            return self._original.trace(*args, **kwargs).jaxpr
        return self._program_for(args, kwargs)[0].original

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The program calls with these arguments run, lowered (:meth:`jaxpr`: the prepared
        folded kernels and biases are constants; its arguments are the per-call inputs).
        Where this JAX switched folding off: the original's lowering."""
        if self._off is not None:
            return self._original.lower(*args, **kwargs)
        prog, leaves = self._program_for(args, kwargs)
        closed = self.jaxpr(*args, **kwargs)
        ins = leaves if len(closed.jaxpr.invars) == len(leaves) else \
            [leaves[i] for i in prog.unknown_idx]
        folding = self._folding_of(args, kwargs)[1]
        options = prog.options if folding is None else \
            chosen_options(prog.executables.get(folding), prog.options)
        return jax.jit(C.jaxpr_as_fun(closed), compiler_options=options).lower(*ins)

    def lower_with_arguments(self, *args, **kwargs) -> jax.stages.Lowered:
        """The folded program lowered with every non-static, non-frozen leaf an argument (an
        artifact's form, ``hlofold.lower``/``export``): sites whose parameters are
        arguments are rescaled in the graph, guarded, with ``in_graph=True``, and left as
        they are otherwise (see :meth:`traced_report`); frozen parameters fold as
        constants. Where this JAX changed what folding reads: the original's lowering."""
        if self._off is not None:
            return self._original.lower(*args, **kwargs)
        prog, leaves = self._program_for(args, kwargs)
        return jax.jit(C.jaxpr_as_fun(self._variant(prog, self._traced_mode())[0])).lower(
            *leaves)

    def split(self, *args, **kwargs) -> Split:
        """The prepare/apply split for these arguments (see :class:`Split`). Where this JAX
        switched folding off: nothing to prepare, ``apply`` runs the original program."""
        if self._off is not None:
            closed = self.original_jaxpr(*args, **kwargs)
            rep = FoldReport([], running=f"the original program ({self._off})",
                             compat=[str(self._off)])
            return Split([], [], closed, rep, self, None, None, self._original)
        prog, leaves = self._program_for(args, kwargs)
        known = [leaves[i] for i in prog.known_idx]
        if any(C.is_tracer(k) for k in known):
            raise ValueError("hlofold: Folded.split needs concrete parameters: call it "
                             "outside jax.jit")
        folding, fn, _ = self._folding_for(prog, known, count=False)
        return Split([prog.leaf_names[i] for i in prog.known_idx],
                     [prog.leaf_names[i] for i in prog.unknown_idx], folding.apply,
                     folding.report, self, prog.key, folding, fn)

    def __repr__(self) -> str:
        name = getattr(self._py, '__qualname__', self._py)
        off = [w for p in self._programs.values() if (w := p.running())]
        if not off:
            return f"<hlofold.fold of {name!r}>"
        return (f"<hlofold.fold of {name!r}: {len(off)} of {len(self._programs)} input "
                f"signatures run {off[0]}>")
