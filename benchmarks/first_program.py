"""The first program of a process: a merged multi-branch CNN's compile options, chosen on its
first calls (``hlofold._front.tune``), next to ``jax.jit`` from the start (issue 69 item 10).

A user's process usually holds one model, the first; ``fold(f)`` compiles it with XLA's
defaults, compiles the YNNPACK option in the background from the second call and measures
the two on the calls after (``hlofold._front.tune``). Each sample here is a fresh process
running one variant of a 4-block RepVGG stack (``benchmarks/repmodels.flat_spec``: 16 input
channels, stride 1) from its first call:

* ``fold``: ``hlofold.fold(apply)`` of the train-time (multi-branch) model;
* ``jit``: ``jax.jit(apply)`` of the same model — doing nothing;
* ``deploy``: ``jax.jit`` of the deploy form a user writes by hand (one conv + bias a block);
* ``deploy after jit`` (not with ``--quick``): the same, in a process that first ran
  ``jax.jit(apply)`` of the train-time model once — XLA:CPU's speed for one executable
  depends on what the process ran before (jaxlib 0.10.2: the deploy form 1.4–1.6× slower as
  a process's first program than after the train-time model ran; 2026-12-04).

Per process: the first call (trace, fold, compile, run), the sum of calls 2–10, 2–50 and
2–``calls`` (the window where ``fold`` compiles and measures), which compile options ``fold``
kept, and then — in the same process, after — steady calls of the variant next to the deploy
form with XLA's defaults and with the option, interleaved: the issue's measurement (``fold /
deploy`` in the first process), and whether the option ``fold`` kept is the faster one there
(``right``: its deploy form within 3 % of the faster of the two). Variants run in shuffled
order round by round. ``python -m benchmarks.first_program [--quick] [--runs N]`` writes
``docs/benchmarks/first_program_cpu_jax<version>.{json,md}``; ``benchmarks.calls`` runs it as
its part 8.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import jax
import numpy as np

from .common import code_info, machine_info, machine_line, run_worker, summary, write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, os.pardir, "docs", "benchmarks")
VARIANTS = ("fold", "jit", "deploy", "deploy after jit")
# (batch, px, width): issue 69 item 10's stack first (batch 8, 32 px, width 32), then one
# where jaxlib 0.12's measured grid had the option faster (batch 1, 56 px, width 128)
ROWS = [(8, 32, 32), (1, 56, 128)]
QUICK_ROWS = [(1, 16, 8)]
WINDOWS = (10, 50)          # calls 2..k summed, besides 2..calls
TIE = 0.03                  # the kept option is "right" within this of the faster one


def worker(variant: str, batch: int, size: int, width: int, calls: int, rounds: int) -> dict:
    """One fresh process: ``variant`` from its first call, then the steady comparison."""
    import hlofold
    from hlofold._compat import xla as X
    from . import repmodels as R
    spec = R.flat_spec(width)
    apply, v, x = R.make("repvgg", size=size, batch=batch, spec=spec)
    dapply, w, _ = R.make_deploy("repvgg", size=size, batch=batch, spec=spec)
    jax.block_until_ready((v, w, x))
    if variant == "deploy after jit":         # the train-time model ran once, first
        jax.block_until_ready(jax.jit(apply)(v, x))
    fn, args = {"fold": (lambda: hlofold.fold(apply), (v, x)),
                "jit": (lambda: jax.jit(apply), (v, x)),
                "deploy": (lambda: jax.jit(dapply), (w, x)),
                "deploy after jit": (lambda: jax.jit(dapply), (w, x))}[variant]
    fn = fn()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    ts = []
    for _ in range(calls - 1):                      # calls 2..calls, each waited for
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    out = {"first_s": first, "window_ms": {f"2-{k}": float(np.sum(ts[:k - 1]) * 1e3)
                                           for k in (*WINDOWS, calls)}}
    if variant == "fold":
        rep = fn.report(v, x)
        out["options"] = "option" if rep.compile_options else "defaults"
        out["note"] = rep.compile_note
    single = {X.YNN_FUSION: X.YNN_SINGLE_OPS}
    fns = {"variant": (fn, args), "deploy": (jax.jit(dapply), (w, x)),
           "deploy, option": (jax.jit(dapply, compiler_options=single), (w, x))}
    per = {k: [] for k in fns}
    for f, a in fns.values():
        jax.block_until_ready(f(*a))
    n = max(1, int(0.03 / max(np.median(ts[-20:]) if ts else 0.01, 1e-6)))
    for r in range(rounds):
        order = list(fns)
        random.Random(r).shuffle(order)
        for k in order:
            f, a = fns[k]
            t0 = time.perf_counter()
            for _ in range(n):
                o = f(*a)
            jax.block_until_ready(o)
            per[k].append((time.perf_counter() - t0) / n * 1e3)
    out["steady_ms"] = {k: float(np.median(t)) for k, t in per.items()}
    out["vs_deploy"] = float(np.median([a / b for a, b in zip(per["variant"], per["deploy"])]))
    if variant == "fold":
        best = min(out["steady_ms"]["deploy"], out["steady_ms"]["deploy, option"])
        kept = out["steady_ms"]["deploy, option" if out["options"] == "option" else "deploy"]
        out["right"] = bool(kept <= best * (1 + TIE))
    return out


def measure(rows, runs: int, calls: int, rounds: int, log, history: bool = True) -> list[dict]:
    """``runs`` fresh processes of each variant per row, shuffled round by round
    (``history``: the ``deploy after jit`` processes too)."""
    variants = VARIANTS if history else VARIANTS[:3]
    res = []
    for batch, size, width in rows:
        got: dict[str, list] = {v: [] for v in variants}
        for r in range(runs):
            order = list(variants)
            random.Random(r).shuffle(order)
            for v in order:
                got[v].append(json.loads(run_worker(
                    ["-m", "benchmarks.first_program", "--worker",
                     json.dumps([v, batch, size, width, calls, rounds])],
                    env={"JAX_PLATFORMS": "cpu"})))
        row = {"batch": batch, "size": size, "width": width, "runs": runs, "calls": calls,
               "first_s": {v: summary([g["first_s"] for g in got[v]]) for v in variants},
               "window_ms": {v: {w: summary([g["window_ms"][w] for g in got[v]])
                                 for w in got[v][0]["window_ms"]} for v in variants},
               "fold_vs_deploy": summary([g["vs_deploy"] for g in got["fold"]]),
               "steady_ms": {v: summary([g["steady_ms"]["variant"] for g in got[v]])
                             for v in variants},
               "deploy_option_vs_deploy": summary(
                   [g["steady_ms"]["deploy, option"] / g["steady_ms"]["deploy"]
                    for v in variants[:3] for g in got[v]]),
               "deploy_option_vs_deploy_after_jit": summary(
                   [g["steady_ms"]["deploy, option"] / g["steady_ms"]["deploy"]
                    for g in got["deploy after jit"]]) if history else None,
               "kept": [g["options"] for g in got["fold"]],
               "right": [g["right"] for g in got["fold"]],
               "notes": [g["note"] for g in got["fold"]]}
        log(f"first program b{batch} {size}px w{width}: kept {row['kept']}, right "
            f"{sum(row['right'])}/{runs}, fold/deploy {row['fold_vs_deploy']['median']:.3f}")
        res.append(row)
    return res


def markdown(rows: list[dict]) -> list[str]:
    """The rows as a Markdown section (``benchmarks.calls`` part 8, and this module's doc)."""
    med = lambda s: f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"  # noqa: E731
    rat = lambda a, b: a["median"] / b["median"]                            # noqa: E731
    L = ["", "## 8. The first program of a process (compile options chosen on its first calls)",
         "", "A 4-block RepVGG stack (16 input channels), each sample a fresh process running "
         "one variant from its first call (`benchmarks/first_program.py`). `fold / deploy`: "
         "steady calls in that first process, after, paired round by round with the deploy "
         "form a user writes (`jax.jit`, XLA's defaults); `kept`: the options `fold` chose in "
         "each process; `right`: the processes whose choice was the faster one there (within "
         f"{TIE:.0%}); calls 2–k: summed, over the same sums of `jax.jit` (doing nothing) and "
         "of the deploy form.", "",
         "| batch | px | width | processes | fold / deploy | kept | right | option / defaults "
         "(deploy) | first call fold / jit | calls 2–10 fold / jit, / deploy | calls 2–50 | "
         "calls 2–N (N) | deploy: first program / after jax.jit(train) ran; option / "
         "defaults there |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["window_ms"]
        win = lambda k: (f"{rat(w['fold'][k], w['jit'][k]):.2f}×, "       # noqa: E731
                         f"{rat(w['fold'][k], w['deploy'][k]):.2f}×")
        last = f"2-{r['calls']}"
        kept = ", ".join(f"{r['kept'].count(k)} {k}" for k in ("defaults", "option")
                         if k in r["kept"])
        L.append(f"| {r['batch']} | {r['size']} | {r['width']} | {r['runs']} | "
                 f"{med(r['fold_vs_deploy'])} | {kept} | {sum(r['right'])}/{r['runs']} | "
                 f"{med(r['deploy_option_vs_deploy'])} | "
                 f"{rat(r['first_s']['fold'], r['first_s']['jit']):.2f}× | {win('2-10')} | "
                 f"{win('2-50')} | {win(last)} ({r['calls']}) | " +
                 (f"{rat(r['steady_ms']['deploy'], r['steady_ms']['deploy after jit']):.2f}×; "
                  f"{med(r['deploy_option_vs_deploy_after_jit'])} |"
                  if r.get("deploy_option_vs_deploy_after_jit") else "– |"))
    return L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny row, one process each")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(*json.loads(a.worker))))
        return 0
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = measure(QUICK_ROWS if a.quick else ROWS, 1 if a.quick else a.runs,
                   30 if a.quick else a.calls, 3 if a.quick else a.rounds, log,
                   history=not a.quick)
    res = {"machine": machine_info(), "code": code_info(), "rows": rows}
    L = [f"# The first program of a process ({'QUICK smoke run' if a.quick else 'full run'})",
         "", machine_line(res["machine"])] + markdown(rows)
    write_doc(a.out, f"first_program_cpu_jax{jax.__version__}", res, L)
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
