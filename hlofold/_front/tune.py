"""Compile options chosen per program, measured on the calls the program makes anyway.

Where branches were merged, the folded program is the deploy form — a chain of single-use
convolutions — and on XLA:CPU whether it runs faster with the library's defaults or with its
YNNPACK fusion limited to single convolutions and dots (``_compat.ynn_single_ops``) depends
on the program and the sizes: RepVGG-A0 at 64 px, batch 8 runs 1.75× slower than the
unmerged program with jaxlib 0.10's defaults and 0.85× with the limit, while at most other
sizes the limit costs 1.1–1.8× and on jaxlib 0.12 it rarely helps
(``docs/benchmarks/branches_grid_cpu_jax*.md``). No rule on the program's shape predicts it
(XLA fuses the chain in both cases), so :class:`Tuned` measures — without making any call
slower than the program compiled with XLA's defaults would be:

* the first call compiles and runs XLA's defaults, as ``jax.jit`` would; the second starts
  compiling the option's executable in a background thread (XLA releases the GIL while it
  compiles; a program called once never pays for it, and the interpreter waits for a
  compile under way before it exits — a daemon thread inside XLA then would abort it);
* until that is ready, calls run the defaults; then the two run in turn in bursts of
  :data:`BURST` calls, all but the first of a burst timed (so those calls wait for their
  results), until each has :data:`SAMPLES` timed calls, and the option is kept only where
  both its fastest and its median call beat the defaults' by more than :data:`MARGIN` (a
  machine busy with other work while measuring keeps the defaults: a wrong choice costs up
  to 1.7×). Bursts, because an executable called right after the other one runs on caches
  the other left (YNNPACK's packed weights among them): call by call in turn, both ran 2×
  slower than either alone, and at one size the option measured faster that way and was
  1.7× slower alone;
* from then on every call runs the chosen executable alone (the steady path calls it
  directly); the report says what was measured (``compile_options``, ``compile_note``);
* programs that donate inputs or have side effects keep the defaults (they cannot run twice).

Both executables compute the same program; only XLA's choice of kernels differs. Under an
enclosing trace the program is inlined (``__wrapped__``). ``BACKGROUND = False`` compiles the
second executable on the first call instead (deterministic, for tests).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import jax

from hlofold import _compat as C
from hlofold._base.report import FoldReport

# the option is kept only where it is this much faster than XLA's defaults (timing noise)
MARGIN = 0.03
# timed calls of each executable before the choice
SAMPLES = 6
# consecutive calls of one executable while measuring (the first of them not timed)
BURST = 3
# the calls measuring takes, once the option's executable is ready
MEASURING = 2 * BURST * -(-SAMPLES // (BURST - 1))
# compile the option's executable in a background thread (False: on the first call)
BACKGROUND = True


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
    gives two, a :class:`Tuned` choosing between them on its first calls."""
    cands = option_candidates(report, options)
    fns = [jax.jit(fun, donate_argnums=tuple(donate_argnums), compiler_options=o)
           for o in cands]
    if len(fns) == 1:
        return fns[0]
    if donate_argnums or effects:        # cannot run twice: XLA's defaults, said
        report.compile_note = ("compiled with XLA's defaults (not measured against the "
                               "YNNPACK option: the program donates inputs or has effects)")
        return fns[0]
    report.compile_note = ("compiled with XLA's defaults; the YNNPACK option is measured "
                           "against them on the first calls")
    return Tuned(fun, fns, cands, report)


class Tuned:
    """One program compiled with each of ``options`` (the first XLA's defaults), the faster
    kept after measuring both on the program's own calls (see the module docstring)."""

    def __init__(self, fun: Callable, fns: list, options: list, report: FoldReport):
        self.__wrapped__ = fun           # inlined under an enclosing trace
        self._fns, self._options, self._reports = fns, options, [report]
        self._lock = threading.Lock()
        self._ready = threading.Event()  # the option's executable is compiled
        self._calls = 0                  # calls before the option's compile starts
        self._times: list[list[float]] = [[], []]
        self._turn = 0                   # the measuring call's number (bursts of BURST)
        self.chosen: Callable | None = None
        self.chosen_options: dict | None = None

    def __call__(self, *args):
        fn = self.chosen
        if fn is not None:
            return fn(*args)
        if any(C.is_tracer(a) for a in args):
            return self._fns[0](*args)
        with self._lock:
            self._calls += 1
            if self._calls == 2 or (self._calls == 1 and not BACKGROUND):
                self._compile_option(args)
            n = self._turn if self._ready.is_set() and self.chosen is None else None
            if n is not None:
                self._turn = n + 1
        if n is None:                    # still compiling, or chosen meanwhile
            return (self.chosen or self._fns[0])(*args)
        k = (n // BURST) % 2
        t0 = time.perf_counter()
        out = jax.block_until_ready(self._fns[k](*args))
        if n % BURST:                    # (a burst's first call warms its caches)
            self._record(k, time.perf_counter() - t0)
        return out

    def _compile_option(self, args: tuple) -> None:
        """Compile (and run once, unseen) the option's executable on these arguments: in a
        background thread, or here (``BACKGROUND = False``)."""
        def work():
            try:          # compiled and run once, unseen: the jit's own cache is warm then
                jax.block_until_ready(self._fns[1](*args))
            except Exception as e:       # noqa: BLE001 — no option then: the defaults stay
                with self._lock:
                    self._settle(0, f"the YNNPACK option did not compile "
                                    f"({type(e).__name__}); XLA's defaults kept")
            self._ready.set()
        if BACKGROUND:
            threading.Thread(target=work, name="hlofold-compile", daemon=False).start()
        else:
            work()

    def _record(self, k: int, dt: float) -> None:
        with self._lock:
            if self.chosen is not None:
                return
            self._times[k].append(dt)
            if min(len(t) for t in self._times) < SAMPLES:
                return
            best = [min(t) for t in self._times]
            mid = [sorted(t)[len(t) // 2] for t in self._times]
            pick = 1 if best[1] < best[0] * (1 - MARGIN) and mid[1] < mid[0] * (1 - MARGIN) \
                else 0
            self._settle(pick, f"compile options measured on {SAMPLES} calls of each: XLA's "
                               f"defaults {best[0] * 1e3:.3g} ms, YNNPACK limited to single "
                               f"ops {best[1] * 1e3:.3g} ms: "
                               + ("the limit kept" if pick else "the defaults kept"))

    def _settle(self, pick: int, note: str) -> None:
        self.chosen_options = self._options[pick]
        for rep in self._reports:
            rep.compile_options = {C.YNN_FUSION: self._options[1][C.YNN_FUSION]} if pick \
                else {}
            rep.compile_note = note
        self._reports = self._reports[:1]
        self.chosen = self._fns[pick]


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
