"""Compile options chosen per program, by measuring both on the first call.

Where branches were merged, the folded program is the deploy form — a chain of single-use
convolutions — and on XLA:CPU whether it runs faster with the library's defaults or with
its YNNPACK fusion limited to single convolutions and dots (``_compat.ynn_single_ops``)
depends on the sizes: at RepVGG-A0's 64 px, batch 8, the defaults grow one fusion through
the chain that runs slower than the unmerged program, and the limit gains 0.85×; at most
other sizes the limit costs 1.1–1.8× (``docs/benchmarks/branches_grid_cpu.md``). No rule on
the program's shape predicts it, so :class:`Tuned` compiles both and keeps the faster one:

* the first call with concrete inputs runs the defaults' executable (its outputs are the
  call's), then the option's, then both again in alternating order for as long as the
  measurement stays a small part of what the two compiles cost (at least one timed run of
  each); the option is kept only where it is faster by more than :data:`MARGIN`;
* the choice is made once per executable (one input signature and fold structure), under a
  lock (concurrent first calls wait for it), and recorded in the report
  (``compile_options``, ``compile_note``);
* programs that donate inputs or have side effects are not run twice: they keep the defaults.

Under an enclosing trace the program is inlined (``__wrapped__``), as any compiled program
with options is.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import jax

from . import _compat as C
from ._core.report import FoldReport

# the option is kept only where it is this much faster than XLA's defaults (timing noise)
MARGIN = 0.03
# the timed runs stop once they cost this fraction of the two first calls (compile + run)
BUDGET = 0.35


def option_candidates(report: FoldReport, options: dict | None) -> list[dict | None]:
    """The compile options worth measuring for a folded program: the user's (XLA's defaults
    for what they leave), and where branches were merged and XLA:CPU compiles it, those with
    the YNNPACK fusion limited to single convolutions and dots — unless the user chose that
    option, or this jaxlib does not take it."""
    if not report.merged or jax.default_backend() != "cpu":
        return [options]
    single = C.ynn_single_ops(options)
    return [options] if single is None else [options, single]


def apply_program(fun: Callable, report: FoldReport, options: dict | None,
                  donate_argnums: Sequence[int] = (), effects: bool = False) -> Callable:
    """``fun`` compiled with the user's ``options`` — or, where :func:`option_candidates`
    gives two, a :class:`Tuned` choosing between them on its first call."""
    cands = option_candidates(report, options)
    fns = [jax.jit(fun, donate_argnums=tuple(donate_argnums), compiler_options=o)
           for o in cands]
    if len(fns) == 1:
        return fns[0]
    if donate_argnums or effects:        # cannot run twice: XLA's defaults, said
        report.compile_note = ("compiled with XLA's defaults (not measured against the "
                               "YNNPACK option: the program donates inputs or has effects)")
        return fns[0]
    report.compile_note = "compile options: measured on the first call"
    return Tuned(fun, fns, cands, report)


class Tuned:
    """One program compiled with each of ``options`` (the first XLA's defaults), the faster
    kept on the first call with concrete inputs (see the module docstring)."""

    def __init__(self, fun: Callable, fns: list, options: list, report: FoldReport):
        self.__wrapped__ = fun           # inlined under an enclosing trace
        self._fns, self._options, self._reports = fns, options, [report]
        self._lock = threading.Lock()
        self.chosen: Callable | None = None
        self.chosen_options: dict | None = None

    def __call__(self, *args):
        fn = self.chosen
        if fn is not None:
            return fn(*args)
        if any(C.is_tracer(a) for a in args):
            return self._fns[0](*args)
        with self._lock:
            if self.chosen is not None:
                return self.chosen(*args)
            return self._choose(args)

    def _choose(self, args: tuple) -> Any:
        t0 = time.perf_counter()
        out = jax.block_until_ready(self._fns[0](*args))   # the call's outputs: the defaults'
        first = time.perf_counter() - t0
        best = self._time_runs(args, first)
        pick = 1 if best[1] < best[0] * (1 - MARGIN) else 0
        self.chosen_options = self._options[pick]
        note = (f"compile options measured on the first call: XLA's defaults "
                f"{best[0] * 1e3:.3g} ms, YNNPACK limited to single ops {best[1] * 1e3:.3g} ms:"
                f" " + ("the limit kept" if pick else "the defaults kept"))
        for rep in self._reports:
            rep.compile_options = {C.YNN_FUSION: self._options[1][C.YNN_FUSION]} if pick \
                else {}
            rep.compile_note = note
        self._reports = [self._reports[0]]
        self.chosen = self._fns[pick]
        return out


    def _time_runs(self, args: tuple, first: float) -> list[float]:
        """The fastest run of each executable (the second compiled here): timed in
        alternating order while that costs under :data:`BUDGET` of the two first calls, at
        least once each and at most five times."""
        t0 = time.perf_counter()
        jax.block_until_ready(self._fns[1](*args))
        first += time.perf_counter() - t0
        times: list[list[float]] = [[], []]
        spent, k = 0.0, 0
        while not times[1] or (spent < BUDGET * first and len(times[1]) < 5):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                jax.block_until_ready(self._fns[i](*args))
                dt = time.perf_counter() - t0
                times[i].append(dt)
                spent += dt
            k += 1
        return [min(t) for t in times]


def share_choice(fn: Callable, source: FoldReport, report: FoldReport) -> None:
    """``report`` (of a folding that runs ``fn``, made for ``source``'s) says what ``source``
    says about its compile options, now or once ``fn`` has chosen."""
    report.compile_options = dict(source.compile_options)
    report.compile_note = source.compile_note
    if isinstance(fn, Tuned) and fn.chosen is None and len(fn._reports) < 8:
        fn._reports.append(report)


def chosen_options(fn: Callable, options: dict | None) -> dict | None:
    """The options ``fn`` (from :func:`apply_program`) runs with: a :class:`Tuned`'s choice
    once made (XLA's defaults until then), else the user's."""
    if isinstance(fn, Tuned):
        return fn.chosen_options if fn.chosen is not None else fn._options[0]
    return options
