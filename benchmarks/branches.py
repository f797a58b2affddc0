"""Multi-branch CNNs: ``hlofold.fold`` next to doing nothing and next to the hand-written
deploy form (issue 38).

For Flax RepVGG-A0-like and MobileOne-S0-like networks (``benchmarks/repmodels.py``, the
published stage widths and depths, trained-looking BatchNorms) at batch 1 and 8:

* ``jit``: ``jax.jit(apply)`` of the train-time (multi-branch) model — doing nothing;
* ``fold``: ``hlofold.fold(apply)`` of the same model (branches merged, BNs folded);
* ``deploy``: ``jax.jit`` of the deploy form a hand-written re-parameterization gives (one
  conv + bias per block; MobileOne a depthwise 3×3 and a 1×1), the same widths — the limit;
* ``under jit``: ``jax.jit(lambda v, x: fold(apply)(v, x))`` — parameters traced, so the
  original program runs: it must cost what ``jit`` costs.

Steady calls are timed in interleaved rounds (each round every variant, ``--calls`` calls
each), reported as medians with min–max; first calls (trace, fold, compile, run) in fresh
processes. For timm's train-time RepVGG-A0 and MobileOne-S0 exported by PyTorch/XLA
(``tests/testdata/stablehlo``), the folded module from ``fold_stablehlo(params=)`` runs next
to the module as given. ``python -m benchmarks.branches [--quick]`` writes
``docs/benchmarks/branches_cpu.{json,md}``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import numpy as np

import hlofold
from hlofold import _compat as C
from hlofold._compat import xla as X

from . import repmodels as R
from .common import (code_info, machine_info, machine_line, now, paired, run_worker, steady,
                     steady_rounds, summary, write_doc)

HERE = os.path.dirname(os.path.abspath(__file__))
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
# what hlofold compiles a merged program with on XLA:CPU
SINGLE = {X.YNN_FUSION: X.YNN_SINGLE_OPS}
OUT = os.path.join(HERE, os.pardir, "docs", "benchmarks")
DATA = os.path.join(HERE, os.pardir, "tests", "testdata", "stablehlo")


def flax_part(arch: str, batch: int, size: int, rounds: int, calls: int) -> dict:
    apply, v, x = R.make(arch, size=size, batch=batch)
    dapply, w, _ = R.make_deploy(arch, size=size, batch=batch)
    folded = hlofold.fold(apply)
    settle(folded, v, x)
    fns = {"jit": jax.jit(apply), "fold": folded, "deploy": jax.jit(dapply),
           "under jit": jax.jit(lambda v, x: folded(v, x)),
           # XLA:CPU's YNNPACK fusion off for one program (a jit's compiler_options, which
           # hlofold.fold keeps): the same choice for doing nothing, the fold and the deploy form
           "jit, no YNN": jax.jit(apply, compiler_options=NO_YNN),
           "fold, no YNN": hlofold.fold(jax.jit(apply, compiler_options=NO_YNN)),
           "deploy, no YNN": jax.jit(dapply, compiler_options=NO_YNN),
           # the deploy form compiled as hlofold compiles the merged program
           "deploy, single": jax.jit(dapply, compiler_options=SINGLE),
           # ... and called with the train-time tree too (jax.jit flattens it, in C++): the
           # limit for a call that takes the trained model's parameters
           "deploy, single, train tree": jax.jit(lambda v, w, x: dapply(w, x),
                                                 compiler_options=SINGLE)}
    args = {k: (w, x) if k.startswith("deploy") else (v, x) for k in fns}
    args["deploy, single, train tree"] = (v, w, x)
    res = steady(fns, args, rounds, calls)
    rep = folded.report(v, x)
    prog = folded.jaxpr(v, x)
    return {"arch": arch, "batch": batch, "size": size, "steady_ms": res,
            "convs": {"train": R.conv_count(jax.make_jaxpr(apply)(v, x)),
                      "fold": R.conv_count(prog),
                      "deploy": R.conv_count(jax.make_jaxpr(dapply)(w, x))},
            "merged": len(rep.merged), "folded": rep.num_folded,
            "compile_options": dict(rep.compile_options)}


_FIRST = """
import json, sys, time, jax, hlofold
from benchmarks import repmodels as R
arch, batch, size, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kw = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
apply, v, x = R.make(arch, size=size, batch=batch, **kw)
jax.block_until_ready(v)
f = jax.jit(apply) if which == "jit" else hlofold.fold(apply)
t = time.perf_counter()
jax.block_until_ready(f(v, x))
print(time.perf_counter() - t)
"""


def first_calls(arch: str, batch: int, size: int, runs: int, **make_kw) -> dict:
    """First call (trace, fold, compile, run) in fresh processes, alternating."""
    out = {"jit": [], "fold": []}
    for _ in range(runs):
        for which in out:
            got = run_worker(["-c", _FIRST, arch, batch, size, which, json.dumps(make_kw)],
                             timeout=None, env={"JAX_PLATFORMS": "cpu"})
            out[which].append(float(got) * 1e3)
    return {k: summary(v) for k, v in out.items()}


def timm_part(arch: str, rounds: int, calls: int) -> dict:
    from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
    sys.path.insert(0, os.path.join(HERE, os.pardir))
    from tests.helpers.torch_weights import weight
    text = open(os.path.join(DATA, f"{arch}_torch_xla.mlir")).read()
    meta = json.load(open(os.path.join(DATA, f"{arch}_torch_xla.json")))
    names = meta["args"]
    ws = {f"arg{i}": weight(n, s.shape)
          for i, (n, s) in enumerate(zip(names, input_specs(text))) if n != "input"}
    x = np.load(os.path.join(DATA, f"{arch}_torch_xla_io.npz"))["x"]
    full = [jax.device_put(ws[f"arg{i}"]) if n != "input" else jax.device_put(x)
            for i, n in enumerate(names)]
    t0 = now()
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=ws)
    fold_s = now() - t0
    orig, new = module_callable(text), module_callable(apply)
    prepared = [jax.device_put(p) for p in prepared]
    res = steady({"original": orig, "folded": new, "jit original": jax.jit(orig),
                   "jit folded": jax.jit(new)},
                  {"original": full, "folded": [jax.device_put(x), *prepared],
                   "jit original": full, "jit folded": [jax.device_put(x), *prepared]},
                  rounds, calls)
    return {"arch": arch, "steady_ms": res, "fold_stablehlo_s": fold_s,
            "convs": {"original": text.count("stablehlo.convolution"),
                      "folded": str(apply).count("stablehlo.convolution"),
                      "timm deploy": meta["deploy_convs"]}}


def markdown(res: dict) -> str:
    lines = [f"# Multi-branch CNNs: fold vs doing nothing vs the deploy form ({res['when']})",
             "", machine_line(res["machine"]), "",
             "Steady calls, ms per call: median (min–max) over interleaved rounds. "
             "`fold/jit` < 1 is faster than doing nothing; `fold/deploy` is the distance to "
             "the hand-written deploy form (goal: ≤ 1.02) compiled with XLA's defaults, "
             "`/deploy same` to the deploy form compiled with the options hlofold compiles the "
             "merged program with (`report.compile_options`: XLA:CPU's YNNPACK fusion limited to "
             "single convolutions and dots), `/train tree` to that deploy form called with the "
             "train-time parameter tree as well (flattened by `jax.jit`, unused).", "",
             "| net | batch | convs train → fold (deploy) | jit | fold | deploy | deploy, same "
             "options | under jit | fold/jit | fold/deploy | fold/deploy same | /train tree | "
             "under jit/jit |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda s: f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"   # noqa: E731
    ynn: list[str] = []
    for r in res["flax"]:
        s = r["steady_ms"]
        if "fold, no YNN" in s:
            ynn.append(f"| {r['arch']} | {r['batch']} | {fmt(s['jit, no YNN'])} | "
                       f"{fmt(s['fold, no YNN'])} | {fmt(s['deploy, no YNN'])} | "
                       f"{s['fold, no YNN']['median'] / s['jit']['median']:.3f} | "
                       f"{s['fold, no YNN']['median'] / s['jit, no YNN']['median']:.3f} | "
                       f"{s['fold, no YNN']['median'] / s['deploy, no YNN']['median']:.3f} |")
        lines.append(
            f"| {r['arch']} ({r['size']} px) | {r['batch']} | {r['convs']['train']} → "
            f"{r['convs']['fold']} ({r['convs']['deploy']}) | {fmt(s['jit'])} | "
            f"{fmt(s['fold'])} | {fmt(s['deploy'])} | {fmt(s['deploy, single'])} | "
            f"{fmt(s['under jit'])} | {s['fold']['median'] / s['jit']['median']:.3f} | "
            f"{s['fold']['median'] / s['deploy']['median']:.3f} | "
            f"{s['fold']['median'] / s['deploy, single']['median']:.3f} | "
            + (f"{s['fold']['median'] / s['deploy, single, train tree']['median']:.3f} | "
               if "deploy, single, train tree" in s else "| ") +
            f"{s['under jit']['median'] / s['jit']['median']:.3f} |")
    if ynn:
        lines += ["", "The same nets with XLA:CPU's YNNPACK fusion off for that one program "
                  "(`jax.jit(apply, compiler_options={\"xla_cpu_experimental_ynn_fusion_type\": "
                  "\"\"})`, which `hlofold.fold` keeps), ms per call:", "",
                  "| net | batch | jit, no YNN | fold, no YNN | deploy, no YNN | "
                  "fold no YNN / jit (default) | / jit no YNN | / deploy no YNN |",
                  "|---|---|---|---|---|---|---|---|", *ynn]
    if res.get("first"):
        lines += ["", "First call (trace, fold, compile, run; fresh processes), ms: median "
                  "(min–max)", "", "| net | batch | jit | fold | fold/jit |", "|---|---|---|---|---|"]
        for r in res["first"]:
            lines.append(f"| {r['arch']} | {r['batch']} | {fmt(r['ms']['jit'])} | "
                         f"{fmt(r['ms']['fold'])} | "
                         f"{r['ms']['fold']['median'] / r['ms']['jit']['median']:.3f} |")
    if res.get("timm"):
        lines += ["", "timm's train-time modules exported by PyTorch/XLA (1×3×32×32), "
                  "`fold_stablehlo(params=)`, ms per call", "",
                  "| module | convs original → folded (timm deploy) | original | folded | "
                  "folded/original | under `jax.jit`: original | folded | folded/original | "
                  "fold_stablehlo s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res["timm"]:
            s = r["steady_ms"]
            lines.append(f"| {r['arch']} | {r['convs']['original']} → {r['convs']['folded']} "
                         f"({r['convs']['timm deploy']}) | {fmt(s['original'])} | "
                         f"{fmt(s['folded'])} | "
                         f"{s['folded']['median'] / s['original']['median']:.3f} | "
                         + (f"{fmt(s['jit original'])} | {fmt(s['jit folded'])} | "
                            f"{s['jit folded']['median'] / s['jit original']['median']:.3f} | "
                            if "jit folded" in s else "| | | ") +
                         f"{r['fold_stablehlo_s']:.2f} |")
    return "\n".join(lines) + "\n"


def call_part(arch: str, size: int, rounds: int, calls: int) -> dict:
    """One batch-1 row: ``fold(f)`` called with the train-time tree, ``fold`` of ``f`` with
    that tree bound (``functools.partial``: a server's one model, the call takes the image
    alone), the deploy form as a user writes it under plain ``jax.jit`` (its own tree, and
    the train-time tree too) and ``jax.jit(f)``; ratios paired round by round."""
    apply, v, x = R.make(arch, size=size, batch=1)
    dapply, w, _ = R.make_deploy(arch, size=size, batch=1)
    fns = {"jit": jax.jit(apply), "fold": hlofold.fold(apply),
           "fold, bound": hlofold.fold(functools.partial(apply, v)),
           "deploy": jax.jit(dapply),
           "deploy, train tree": jax.jit(lambda v, w, x: dapply(w, x))}
    args = {"jit": (v, x), "fold": (v, x), "fold, bound": (x,), "deploy": (w, x),
            "deploy, train tree": (v, w, x)}
    settle(fns["fold"], v, x)
    settle(fns["fold, bound"], x)
    times = steady_rounds(fns, args, rounds, calls, rotate=True)
    ident = jax.jit(lambda v, x: x)          # what jax.jit's dispatch of the tree alone costs
    jax.block_until_ready(ident(v, x))
    t0, n = now(), 2000
    for _ in range(n):
        ident(v, x)
    return {"arch": arch, "size": size, "leaves": len(jax.tree_util.tree_leaves(v)),
            "deploy_leaves": len(jax.tree_util.tree_leaves(w)),
            "steady_ms": {k: summary(t) for k, t in times.items()},
            "ratios": {**{k: paired(times, k, "deploy")
                          for k in ("fold", "fold, bound", "deploy, train tree", "jit")},
                       "fold / deploy, train tree": paired(times, "fold", "deploy, train tree")},
            "tree_dispatch_us": (now() - t0) / n * 1e6}


def batch1(rounds: int, calls: int, sizes: list, out: str) -> dict:
    """The batch-1 rows alone (``--batch1``), at each of ``sizes``: where the distance to
    the deploy form is the call itself; written to ``branches_b1_cpu_jax<version>.{md,json}``
    (one per JAX it ran on)."""
    import datetime
    rows = [call_part(arch, size, rounds, calls) for size in sizes for arch in R.ARCHS]
    res = {"when": datetime.date.today().isoformat(), "machine": machine_info(),
           "code": code_info(), "rounds": rounds, "calls": calls, "flax": rows}
    fmt = lambda s: f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"   # noqa: E731
    L = [f"# Multi-branch CNNs at batch 1: the call, next to the deploy form ({res['when']})",
         "", machine_line(res["machine"]), "",
         f"`python -m benchmarks.branches --batch1 --rounds {rounds} --calls {calls}`: one "
         "run, interleaved rounds (each starting at the next variant). Left: ms per call, "
         "median (min–max); right: the ratio to the deploy form **in the same round**, "
         "median (min–max) over rounds. `deploy`: the hand-written deploy form under plain "
         "`jax.jit` (XLA's defaults), called with its own parameters; `fold`: "
         "`hlofold.fold(apply)(variables, x)`, the train-time tree; `fold, bound`: "
         "`hlofold.fold(functools.partial(apply, variables))(x)`; `deploy, train tree`: the "
         "deploy form called with the train-time tree as well (unused: what taking that tree "
         "costs `jax.jit`); `tree µs`: `jax.jit(lambda v, x: x)(variables, x)`, dispatch alone. "
         "`fold / deploy train tree`: both called with the train-time tree (the same input).",
         "", "| net | px | leaves | jit | fold | fold, bound | deploy | fold / deploy | "
         "bound / deploy | deploy train tree / deploy | fold / deploy train tree | jit / deploy "
         "| tree µs |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, q = r["steady_ms"], r["ratios"]
        L.append(f"| {r['arch']} | {r['size']} | {r['leaves']} ({r['deploy_leaves']}) | "
                 f"{fmt(s['jit'])} | {fmt(s['fold'])} | {fmt(s['fold, bound'])} | "
                 f"{fmt(s['deploy'])} | {fmt(q['fold'])} | {fmt(q['fold, bound'])} | "
                 f"{fmt(q['deploy, train tree'])} | {fmt(q['fold / deploy, train tree'])} | "
                 f"{fmt(q['jit'])} | "
                 f"{r['tree_dispatch_us']:.0f} |")
    write_doc(out, f"branches_b1_cpu_jax{jax.__version__}", res, L)
    print("\n".join(L))
    return res


# (kind, batch, px, width): the rows of issue 53's table first, then more sizes and kinds
GRID = ([("repvgg", b, px, w) for b, px, w in
         [(1, 32, 32), (8, 32, 32), (1, 64, 64), (8, 64, 64), (1, 112, 32), (4, 112, 64),
          (32, 32, 16), (1, 224, 16), (8, 32, 128), (1, 56, 128)]] +
        [(k, b, px, w) for k in ("acnet", "mobileone", "dbb")
         for b, px, w in [(1, 32, 32), (8, 64, 64), (1, 112, 32)]] +
        # the published networks (widths 48-1280), where jaxlib 0.10's defaults ran the
        # merged RepVGG-A0 at batch 8 1.75x slower than the unmerged program
        [(a, b, 64, 0) for a in R.ARCHS for b in (1, 8)])
QUICK_GRID = [("repvgg", 1, 16, 8), ("mobileone", 2, 16, 8)]


def grid_row(kind: str, batch: int, size: int, width: int, rounds: int,
             first: int = 0) -> dict:
    """One row of the option grid: a 4-block stack of ``kind`` (width ``width``, 16 input
    channels, stride 1) next to its deploy form as a user writes it (``jax.jit``, XLA's
    defaults): ``hlofold.fold`` as shipped, ``jax.jit`` of the train-time form, the fold's
    own apply program compiled by plain ``jax.jit`` and with the YNNPACK option, and the
    deploy form with that option — ratios to the deploy form paired round by round."""
    spec = None if kind in R.ARCHS else R.flat_spec(width)
    apply, v, x = R.make(kind, size=size, batch=batch, spec=spec)
    dapply, w, _ = R.make_deploy(kind, size=size, batch=batch, spec=spec)
    folded = hlofold.fold(apply)
    settle(folded, v, x)
    sp = folded.split(v, x)
    prepared = sp.prepare(v, x)
    app = C.jaxpr_as_fun(sp.apply_jaxpr)
    fns = {"deploy": jax.jit(dapply), "fold": folded, "jit": jax.jit(apply),
           "apply, plain jit": jax.jit(app), "apply, option": jax.jit(app, compiler_options=SINGLE),
           "deploy, option": jax.jit(dapply, compiler_options=SINGLE)}
    args = {"deploy": (w, x), "fold": (v, x), "jit": (v, x), "apply, plain jit": (*prepared, x),
            "apply, option": (*prepared, x), "deploy, option": (w, x)}
    jax.block_until_ready(fns["deploy"](w, x))
    t0 = now()
    jax.block_until_ready(fns["deploy"](w, x))
    calls = max(1, min(20, int(0.03 / max(now() - t0, 1e-6))))   # a round ≈ 30 ms a variant
    times = steady_rounds(fns, args, rounds, calls, rotate=True)
    rep = folded.report(v, x)
    return {"kind": kind, "batch": batch, "size": size, "width": width, "calls": calls,
            "steady_ms": {k: summary(t) for k, t in times.items()},
            "ratios": {k: paired(times, k, "deploy") for k in fns if k != "deploy"},
            "merged": len(rep.merged), "choice": dict(rep.compile_options),
            "note": rep.compile_note,
            "first_ms": first_calls(kind, batch, size, first,
                                    **({"spec": spec} if spec else {})) if first else None}


def settle(folded, *args, limit: float = 120.0) -> None:
    """Call ``folded`` until its compile options are chosen (``hlofold._front.tune``: measured on
    its first calls, the option compiled in the background): its steady state."""
    import time
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        jax.block_until_ready(folded(*args))
        note = folded.report(*args).compile_note
        if note is None or " kept" in note or "not measured" in note:
            return
        time.sleep(0.01)


def fresh_grid_row(*row) -> dict:
    """:func:`grid_row` in a fresh process (``--grid-row``): the row's model is the first
    program there, as in a user's process (the option's choice is measured on it)."""
    return json.loads(run_worker(["-m", "benchmarks.branches", "--grid-row", json.dumps(row)],
                                 timeout=None, env={"JAX_PLATFORMS": "cpu"}))


def grid(rounds: int, rows: list, out: str, first: int = 0) -> dict:
    """``--grid``: :func:`grid_row` for each of ``rows``; written to
    ``branches_grid_cpu_jax<version>.{md,json}`` (one per JAX the grid ran on)."""
    import datetime
    res = {"when": datetime.date.today().isoformat(), "machine": machine_info(),
           "code": code_info(), "rounds": rounds, "rows": []}
    for row in rows:        # each row in a fresh process: its model the process's first
        res["rows"].append(fresh_grid_row(*row, rounds, first))       # (issue 69 item 10)
        print(res["rows"][-1], flush=True)
    fmt = lambda s: f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"   # noqa: E731
    L = [f"# Multi-branch stacks next to the deploy form a user writes ({res['when']})", "",
         machine_line(res["machine"]), "",
         f"`python -m benchmarks.branches --grid --rounds {rounds}`: a 4-block stack (16 input "
         "channels, stride 1) of each kind, trained-looking BatchNorms, each row in a fresh "
         "process (its model the first program there). Every ratio is to "
         "**`jax.jit` of the hand-written deploy form with XLA's defaults** in the same round "
         "(median, min–max over rounds; rounds rotate which variant runs first). `fold`: "
         "`hlofold.fold(apply)(variables, x)` as shipped; `jit`: `jax.jit(apply)` of the "
         "train-time form; `apply, plain`/`apply, option`: the fold's own apply program "
         "(`split().apply_jaxpr`) compiled by plain `jax.jit`, and with "
         f"`{X.YNN_FUSION}` limited to single convolutions and dots; `deploy, option`: the "
         "deploy form with that option; `chosen`: the options `fold` compiled with "
         "(`report.compile_options`, measured on the first call: `-` XLA's defaults); "
         "`first`: the first call (trace, fold, compile, run) of `fold` over `jax.jit`'s, "
         "fresh processes, median of the runs.", "",
         "| kind | batch | px | width | deploy ms | fold / deploy | jit / deploy | "
         "apply, plain / deploy | apply, option / deploy | deploy, option / deploy | chosen | "
         "first fold / jit |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        q, f1 = r["ratios"], r.get("first_ms")
        L.append(f"| {r['kind']} | {r['batch']} | {r['size']} | {r['width']} | "
                 f"{r['steady_ms']['deploy']['median']:.2f} | {fmt(q['fold'])} | "
                 f"{fmt(q['jit'])} | {fmt(q['apply, plain jit'])} | {fmt(q['apply, option'])} | "
                 f"{fmt(q['deploy, option'])} | {'option' if r['choice'] else '-'} | "
                 + (f"{f1['fold']['median'] / f1['jit']['median']:.2f} |" if f1 else "|"))
    write_doc(out, f"branches_grid_cpu_jax{jax.__version__}", res, L)
    print("\n".join(L))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--first-runs", type=int, default=3)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--batch1", action="store_true", help="the batch-1 rows alone")
    ap.add_argument("--grid", action="store_true",
                    help="the option grid: stacks of each kind at many sizes, next to the "
                         "deploy form a user writes")
    ap.add_argument("--grid-row", help=argparse.SUPPRESS)   # one row, in this process
    a = ap.parse_args(argv)
    if a.grid_row:
        kind, batch, size, width, rounds, first = json.loads(a.grid_row)
        print(json.dumps(grid_row(kind, batch, size, width, rounds, first=first), default=str))
        return {}
    if a.grid:
        return grid(2 if a.quick else a.rounds, QUICK_GRID if a.quick else GRID, a.out,
                    first=1 if a.quick else a.first_runs)
    if a.batch1:
        return batch1(a.rounds, a.calls, [16] if a.quick else [a.size, 224], a.out)
    size, rounds, calls, first = (16, 2, 2, 0) if a.quick else \
        (a.size, a.rounds, a.calls, a.first_runs)
    import datetime
    res = {"when": datetime.date.today().isoformat(), "machine": machine_info(),
           "code": code_info(), "flax": [], "first": [], "timm": []}
    for arch in R.ARCHS:
        for batch in (1,) if a.quick else (1, 8):     # --quick: one batch (compiles cost)
            res["flax"].append(flax_part(arch, batch, size, rounds, calls))
            print(res["flax"][-1], flush=True)
            if first:
                res["first"].append({"arch": arch, "batch": batch,
                                     "ms": first_calls(arch, batch, size, first)})
        res["timm"].append(timm_part(arch, rounds, calls))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "branches_cpu.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(a.out, "branches_cpu.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
