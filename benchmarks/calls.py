"""hlofold next to doing nothing, in every way it is called: one run, interleaved, ratios.

``python -m benchmarks.calls [--quick] [--out DIR] [--name NAME]`` measures

1. **first call** — ``hlofold.fold(f)`` and ``fold(f, freeze=0)`` vs ``jax.jit(f)``: trace +
   fold + compile + run, each sample in a fresh process (no cache shared), variants
   interleaved round by round; ResNet-50 in Flax and Haiku at 64 and 224 px, and the
   ``flaxmodels`` ResNet-18 at 64 px, batch 2 (the small CNN users start with; where
   ``flaxmodels`` is installed);
2. **under the user's jit** — steady calls of ``jax.jit(fold(f))`` vs ``jax.jit(f)`` (and of
   a jitted closure over the parameters), batch 1 and 8, every benchmark network;
3. **dispatch** — steady calls of ``fold(f)``, ``freeze=`` vs ``jax.jit(f)`` on a one-conv
   model (per-call overhead), and of ``fold(f)`` on a Flax NNX ViT whose state holds PRNG
   keys (every norm left by the cost rule: a call that is all dispatch);
4. **parameters changing every call** — a new parameter pytree per call;
5. **artifacts** — a folded StableHLO module whose weights are arguments (apply module of
   ``fold_stablehlo(split=True)``) vs the original module, per call;
6. **forward folds behind padding** — ``fold(f)`` and ``freeze=`` (called directly and under
   the user's ``jax.jit``) vs ``jax.jit(f)`` where an affine in front of a SAME conv folds
   into a per-position bias map: first call and steady calls, batch 1 and 8, with XLA's cost
   analysis of both compiled programs;
7. **transformer** — a 0.54 B Llama-style decoder under ``fold(f)`` vs ``jax.jit(f)``: first
   call (fresh processes), steady calls, new parameter values, peak memory, and the prepare
   step both ways (``benchmarks/transformer.py``);
8. **the first program of a process** — a merged RepVGG stack whose compile options ``fold``
   measures on its first calls, from the first call on, fresh processes, next to ``jax.jit``
   and the hand deploy form (``benchmarks/first_program.py``).

Every figure is a median over rounds with its [min–max]; a ratio is hlofold's median over
doing nothing's median from the same run. The machine is stamped in the output
(``DIR/NAME.json`` and ``.md``). ``--quick``: tiny networks, few rounds (a smoke test).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time

import jax

import hlofold

from . import first_program, transformer
from . import workloads as W
from .common import (code_info, kept_runs, machine_info, machine_line, ratio, run_of,
                     run_worker, summary)


# --------------------------------------------------------------------------- 1. first call

FIRST_BATCH = {"flaxmodels-resnet18": 2}      # (as issue 69 measured it)


def first_call_worker(net: str, size: int, variant: str) -> float:
    """Run in a fresh process: seconds of the first call of ``variant`` (nothing cached)."""
    f, params, x = W.network(net, size, batch=FIRST_BATCH.get(net, 1))
    g = {"jit": lambda: jax.jit(f), "fold": lambda: hlofold.fold(f),
         "freeze": lambda: hlofold.fold(f, freeze=0)}[variant]()
    t0 = time.perf_counter()
    jax.block_until_ready(g(params, x))
    return time.perf_counter() - t0


def first_calls(nets, sizes, rounds: int, log) -> list[dict]:
    rows = []
    for net in nets:
        for size in sizes:
            times: dict[str, list] = {"jit": [], "fold": [], "freeze": []}
            for r in range(rounds):
                order = list(times)
                random.Random(r).shuffle(order)
                for v in order:
                    times[v].append(float(run_worker(
                        ["-m", "benchmarks.calls", "--first-call-worker", net, size, v])))
            s = {k: summary(v) for k, v in times.items()}
            row = {"net": net, "size": size, "batch": FIRST_BATCH.get(net, 1), "seconds": s,
                   "fold_vs_jit": ratio(s["fold"], s["jit"]),
                   "freeze_vs_jit": ratio(s["freeze"], s["jit"])}
            log(f"first call {net} {size}px: jit {s['jit']['median']:.2f}s, fold "
                f"{row['fold_vs_jit']:.2f}x, freeze {row['freeze_vs_jit']:.2f}x")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- steady calls

def interleaved(fns: dict, args: dict, rounds: int, calls: int,
                min_round_s: float = 0.0) -> dict:
    """Per variant: per-call seconds, median of each round's mean, rounds interleaved.
    ``calls`` per round, more if needed for a round to last ``min_round_s``."""
    for k, fn in fns.items():                       # compile and warm up
        jax.block_until_ready(fn(*args[k]))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args[k]))
        calls = max(calls, int(min_round_s / max(time.perf_counter() - t0, 1e-6)))
    per = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns)
        random.Random(r).shuffle(order)
        for k in order:
            fn, a = fns[k], args[k]
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*a)
            jax.block_until_ready(out)
            per[k].append((time.perf_counter() - t0) / calls)
    return {k: summary(v) for k, v in per.items()}


def under_jit(nets, batches, size, rounds, calls, log) -> list[dict]:
    rows = []
    for net in nets:
        for b in batches:
            f, params, x = W.network(net, size, batch=b)
            folded = hlofold.fold(f)
            fns = {"jit": jax.jit(f), "jit_of_fold": jax.jit(folded),
                   "closure_jit": jax.jit(lambda x, f=f, params=params: f(params, x)),
                   "closure_jit_of_fold": jax.jit(lambda x, g=folded, params=params:
                                                  g(params, x))}
            args = {"jit": (params, x), "jit_of_fold": (params, x),
                    "closure_jit": (x,), "closure_jit_of_fold": (x,)}
            s = interleaved(fns, args, rounds, calls, min_round_s=0.5)
            rep = folded.traced_report(params, x)
            ops = [op_counts(jax.jit(g).lower(params, x).as_text()) for g in (f, folded)]
            row = {"net": net, "batch": b, "seconds": s,
                   "jit_of_fold_vs_jit": ratio(s["jit_of_fold"], s["jit"]),
                   "closure_vs_jit": ratio(s["closure_jit_of_fold"], s["closure_jit"]),
                   "traced_sites_folded": rep.num_folded,
                   "traced_sites": len(rep.sites),
                   "same_program": ops[0] == ops[1], "ops": ops[0],
                   # XLA's cost analysis of the two compiled programs
                   "same_cost": cost(fns["jit"], args["jit"]) ==
                   cost(fns["jit_of_fold"], args["jit_of_fold"])}
            log(f"under jit {net} b{b}: jit(fold(f)) {row['jit_of_fold_vs_jit']:.3f}x, "
                f"jit(closure) {row['closure_vs_jit']:.3f}x")
            rows.append(row)
    return rows


def op_counts(text: str) -> dict:
    """StableHLO ops by name in a lowered module: two programs with the same counts do the
    same work (names, locations and metadata aside)."""
    import collections
    import re
    return dict(collections.Counter(re.findall(r"= (stablehlo\.\w+)", text)))


def dispatch(rounds, calls, log) -> dict:
    f, params, x = W.one_conv()
    fns = {"jit": jax.jit(f), "fold": hlofold.fold(f), "freeze": hlofold.fold(f, freeze=0)}
    s = interleaved(fns, {k: (params, x) for k in fns}, rounds, calls)
    row = {"seconds": s, "fold_vs_jit": ratio(s["fold"], s["jit"]),
           "freeze_vs_jit": ratio(s["freeze"], s["jit"])}
    log(f"dispatch one conv: jit {s['jit']['median'] * 1e6:.1f}us, fold "
        f"{row['fold_vs_jit']:.2f}x, freeze {row['freeze_vs_jit']:.2f}x")
    try:
        g, state, x = W.nnx_vit_keys()
    except ImportError:                          # (a Flax without NNX)
        return row
    fns = {"jit": jax.jit(g), "fold": hlofold.fold(g)}
    k = interleaved(fns, {v: (state, x) for v in fns}, rounds, max(10, calls // 10))
    row["nnx_keys"] = {"seconds": k, "fold_vs_jit": ratio(k["fold"], k["jit"]),
                       "keys": sum(jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key)
                                   for l in jax.tree_util.tree_leaves(state)),
                       "leaves": len(jax.tree_util.tree_leaves(state)),
                       "folded": fns["fold"].report(state, x).num_folded}
    log(f"dispatch NNX ViT with keys: jit {k['jit']['median'] * 1e6:.1f}us, fold "
        f"{row['nnx_keys']['fold_vs_jit']:.3f}x")
    return row


def changing_params(net, size, calls, log) -> dict:
    """A new parameter pytree on every call (e.g. evaluating during training): the total
    extra time over ``calls`` calls, and the per-call ratio over the second half (after
    hlofold switched that signature to the original program)."""
    f, params, x = W.network(net, size, batch=1)
    sets = [jax.tree.map(lambda a, k=k: a * (1 + 1e-3 * k), params) for k in range(calls)]
    jax.block_until_ready(sets)
    fns = {"jit": jax.jit(f), "fold": hlofold.fold(f)}
    for g in fns.values():
        jax.block_until_ready(g(params, x))                     # first call not counted
    per = {k: [] for k in fns}
    for p in sets:                                  # interleaved: each set through both
        for k, g in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(g(p, x))
            per[k].append(time.perf_counter() - t0)
    half = calls // 2
    row = {"net": net, "calls": calls,
           "extra_seconds_total": sum(per["fold"]) - sum(per["jit"]),
           "second_half": {k: summary(v[half:]) for k, v in per.items()}}
    row["second_half_fold_vs_jit"] = ratio(row["second_half"]["fold"],
                                           row["second_half"]["jit"])
    log(f"changing params {net}: +{row['extra_seconds_total']:.2f}s over {calls} calls, "
        f"then {row['second_half_fold_vs_jit']:.2f}x")
    return row


def cost(fn, args) -> dict:
    """XLA's own cost analysis of the compiled program: deterministic, unlike timings."""
    return cost_of(fn.lower(*args).compile())


def cost_of(compiled) -> dict:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def artifacts(rounds, calls, log, quick=False) -> list[dict]:
    rows = []
    for name, (orig, o_args, folded, f_args) in W.artifacts(quick).items():
        s = interleaved({"original": orig, "folded": folded},
                        {"original": o_args, "folded": f_args}, rounds, calls)
        row = {"module": name, "seconds": s, "folded_vs_original":
               ratio(s["folded"], s["original"]),
               "cost": {"original": cost(orig, o_args), "folded": cost(folded, f_args)}}
        c = row["cost"]
        log(f"artifact {name}: folded {row['folded_vs_original']:.3f}x the original; XLA "
            f"cost analysis: flops {c['folded']['flops'] / c['original']['flops']:.3f}x, "
            f"bytes {c['folded']['bytes'] / c['original']['bytes']:.3f}x")
        rows.append(row)
    return rows


def forward(size, rounds, calls, first_rounds, log) -> list[dict]:
    rows = []
    for net in ("fwd-stem", "fwd-bn-conv"):
        first = first_calls([net], [size], first_rounds, log)[0]
        for b in (1, 8):
            f, params, x = W.network(net, size, batch=b)
            fns = {"jit": jax.jit(f), "fold": hlofold.fold(f),
                   "freeze": hlofold.fold(f, freeze=0)}
            fns["jit_of_fold"] = jax.jit(fns["fold"])           # under the user's jit
            fns["jit_of_freeze"] = jax.jit(hlofold.fold(f, freeze=0))
            s = interleaved(fns, {k: (params, x) for k in fns}, rounds, calls,
                            min_round_s=0.3)
            folded = fns["fold"].lower(params, x)        # what calls run: x its argument
            row = {"net": net, "size": size, "batch": b, "seconds": s,
                   "fold_vs_jit": ratio(s["fold"], s["jit"]),
                   "freeze_vs_jit": ratio(s["freeze"], s["jit"]),
                   "jit_of_fold_vs_jit": ratio(s["jit_of_fold"], s["jit"]),
                   "jit_of_freeze_vs_jit": ratio(s["jit_of_freeze"], s["jit"]),
                   "sites_folded": fns["fold"].report(params, x).num_folded,
                   "cost": {"original": cost(fns["jit"], (params, x)),
                            "folded": cost_of(folded.compile())},
                   "first_call": first if b == 1 else None}
            log(f"forward {net} b{b}: fold {row['fold_vs_jit']:.3f}x, freeze "
                f"{row['freeze_vs_jit']:.3f}x")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- report

def same_cost(row: dict) -> str:
    """", same XLA cost" when the row compared the compiled programs' cost analyses."""
    if "same_cost" not in row:
        return ""
    return ", same XLA cost" if row["same_cost"] else ", XLA cost differs"


def to_markdown(res: dict) -> str:
    m = res["machine"]
    ms = lambda d: f"{d['median'] * 1e3:.2f} [{d['min'] * 1e3:.2f}–{d['max'] * 1e3:.2f}]"  # noqa
    us = lambda d: f"{d['median'] * 1e6:.1f} [{d['min'] * 1e6:.1f}–{d['max'] * 1e6:.1f}]"  # noqa
    sec = lambda d: f"{d['median']:.2f} [{d['min']:.2f}–{d['max']:.2f}]"  # noqa: E731
    L = [f"# hlofold vs doing nothing ({'QUICK smoke run' if res['quick'] else 'full run'})",
         "", f"Machine: {machine_line(m)}; {m['date_utc']}; code {res['code'].get('git_commit')}",
         "", "Medians over interleaved rounds, [min–max]; ratio = hlofold / doing nothing."
         + "".join(f" Parts {', '.join(parts)} are from the run of {when} (code {code}), "
                   "same machine." for (when, code), parts in kept_runs(res).items()), "",
         "## 1. First call (fresh process per sample)", "",
         "| network | jax.jit(f) s | fold(f) s | freeze= s | fold/jit | freeze/jit |",
         "|---|---|---|---|---|---|"]
    for r in res["first_call"]:
        s = r["seconds"]
        b = f", batch {r['batch']}" if r.get("batch", 1) != 1 else ""
        L.append(f"| {r['net']} {r['size']}px{b} | {sec(s['jit'])} | {sec(s['fold'])} | "
                 f"{sec(s['freeze'])} | **{r['fold_vs_jit']:.2f}×** | "
                 f"**{r['freeze_vs_jit']:.2f}×** |")
    L += ["", "## 2. Under the user's jit (steady state, ms per call)", "",
          "| network | batch | jax.jit(f) | jax.jit(fold(f)) | ratio | same StableHLO ops | "
          "jit(closure) | jit(closure of fold) | ratio | traced sites folded |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["under_jit"]:
        s = r["seconds"]
        L.append(f"| {r['net']} | {r['batch']} | {ms(s['jit'])} | {ms(s['jit_of_fold'])} | "
                 f"**{r['jit_of_fold_vs_jit']:.3f}×** | "
                 f"{'yes' if r.get('same_program') else 'no'}{same_cost(r)} | "
                 f"{ms(s['closure_jit'])} | "
                 f"{ms(s['closure_jit_of_fold'])} | **{r['closure_vs_jit']:.3f}×** | "
                 f"{r['traced_sites_folded']}/{r['traced_sites']} |")
    d = res["dispatch"].get("seconds") if res["dispatch"] else None
    L += ["", "## 3. Dispatch: one-conv model (µs per call)", ""] + ([] if d is None else [
          "| jax.jit(f) | fold(f) | freeze= | fold/jit | freeze/jit |", "|---|---|---|---|---|",
          f"| {us(d['jit'])} | {us(d['fold'])} | {us(d['freeze'])} | "
          f"**{res['dispatch']['fold_vs_jit']:.2f}×** | "
          f"**{res['dispatch']['freeze_vs_jit']:.2f}×** |"])
    k = (res["dispatch"] or {}).get("nnx_keys")
    if k:
        L += ["", f"Flax NNX ViT (state: {k['leaves']} leaves, {k['keys']} of them PRNG keys; "
              f"{k['folded']} sites folded): jax.jit(f) {us(k['seconds']['jit'])} µs, fold(f) "
              f"{us(k['seconds']['fold'])} µs per call: **{k['fold_vs_jit']:.3f}×**."]
    c = res["changing_params"]
    h = c.get("second_half")
    L += ["", "## 4. A new parameter pytree on every call", ""] + ([] if not c else [
          f"{c['net']}, {c['calls']} calls, each with new parameter arrays. hlofold prepares "
          "(folds on the host) the first few, then runs the original program for that "
          f"signature (one more compile): **+{c['extra_seconds_total']:.2f} s in all** over "
          f"jax.jit, then per call {ms(h['fold'])} vs {ms(h['jit'])} ms: "
          f"**{c['second_half_fold_vs_jit']:.2f}×** over the second half."])
    L += ["", "## 5. Artifacts whose weights are arguments (ms per call)", "",
          "| module | original | folded (apply module, prepared weights) | ratio | "
          "XLA flops, folded/original | XLA bytes accessed, folded/original |",
          "|---|---|---|---|---|---|"]
    for r in res["artifacts"]:
        s, c = r["seconds"], r.get("cost")
        rel = (lambda k: f"{c['folded'][k] / c['original'][k]:.3f}×" if c and
               c["original"][k] else "–")
        L.append(f"| {r['module']} | {ms(s['original'])} | {ms(s['folded'])} | "
                 f"**{r['folded_vs_original']:.3f}×** | {rel('flops')} | {rel('bytes')} |")
    L += ["", "## 6. Forward folds behind SAME padding (per-position bias map; ms per call)",
          "", "| network | batch | sites folded | jax.jit(f) | fold(f) | freeze= | fold/jit | "
          "freeze/jit | jit(fold)/jit, jit(freeze=)/jit | XLA flops, folded/original | "
          "XLA bytes, folded/original | first call fold/jit, freeze/jit |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("forward", []):
        s, c, fc = r["seconds"], r["cost"], r["first_call"]
        rel = lambda k: f"{c['folded'][k] / c['original'][k]:.3f}×"  # noqa: E731
        L.append(f"| {r['net']} {r['size']}px | {r['batch']} | {r['sites_folded']} | "
                 f"{ms(s['jit'])} | {ms(s['fold'])} | {ms(s['freeze'])} | "
                 f"**{r['fold_vs_jit']:.3f}×** | **{r['freeze_vs_jit']:.3f}×** | "
                 f"{r['jit_of_fold_vs_jit']:.3f}×, {r['jit_of_freeze_vs_jit']:.3f}× | "
                 f"{rel('flops')} | {rel('bytes')} | " +
                 (f"{fc['fold_vs_jit']:.2f}×, {fc['freeze_vs_jit']:.2f}× "
                  f"(jit {fc['seconds']['jit']['median']:.2f} s) |" if fc else "– |"))
    if res.get("transformer"):
        L += transformer.markdown(res["transformer"])
    if res.get("first_program"):
        L += first_program.markdown(res["first_program"])
    L += ["", "Timings on this VM vary by ±10–20% between rounds; XLA's cost analysis of the "
          "two compiled programs (same compiler, same machine) is the deterministic part of "
          "the comparison."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default=None)
    ap.add_argument("--first-call-worker", nargs=3, metavar=("NET", "SIZE", "VARIANT"))
    ap.add_argument("--parts",
                    default="first,jit,dispatch,changing,artifacts,forward,transformer,tuning")
    ap.add_argument("--first-nets", help="comma-separated networks of part 'first' "
                    "(default: the ResNet-50s, and flaxmodels' ResNet-18 where installed)")
    ap.add_argument("--keep-from", help="a JSON of an earlier run on this machine: the parts "
                    "not run now are taken from it")
    a = ap.parse_args(argv)
    if a.first_call_worker:
        net, size, variant = a.first_call_worker
        print(first_call_worker(net, int(size), variant))
        return 0
    log = lambda s: print(s, flush=True)  # noqa: E731
    q = a.quick
    parts = set(a.parts.split(","))
    res = {"quick": q, "machine": machine_info(), "code": code_info()}
    t0 = time.perf_counter()
    nets = a.first_nets.split(",") if a.first_nets else (
        ["tiny-flax"] if q else ["flax-resnet50", "haiku-resnet50"])
    res["first_call"] = first_calls(nets, [32] if q else [64, 224], 2 if q else 5, log) \
        if "first" in parts else []
    if "first" in parts and not q and not a.first_nets and \
            importlib.util.find_spec("flaxmodels") is not None:
        res["first_call"] += first_calls(["flaxmodels-resnet18"], [64], 7, log)
    res["under_jit"] = under_jit(
        ["tiny-flax"] if q else ["flax-resnet18", "flax-resnet50", "flax-mobilenetv2",
                                 "haiku-resnet50"],
        [1, 2] if q else [1, 8], 32 if q else 112, 3 if q else 9, 3 if q else 20,
        log) if "jit" in parts else []
    res["dispatch"] = dispatch(3 if q else 15, 20 if q else 2000, log) \
        if "dispatch" in parts else {}
    res["changing_params"] = changing_params("tiny-flax" if q else "flax-resnet50",
                                             32 if q else 64, 10 if q else 40, log) \
        if "changing" in parts else {}
    res["artifacts"] = artifacts(3 if q else 25, 3 if q else 10, log, q) \
        if "artifacts" in parts else []
    res["forward"] = forward(32 if q else 224, 3 if q else 15, 3 if q else 10,
                             1 if q else 7, log) \
        if "forward" in parts else []
    res["transformer"] = transformer.measure(q, 2 if q else 5, log) \
        if "transformer" in parts else {}
    res["first_program"] = first_program.measure(
        first_program.QUICK_ROWS if q else first_program.ROWS, 1 if q else 5, 30 if q else 200,
        3 if q else 15, log, history=not q) if "tuning" in parts else []
    if a.keep_from:
        with open(a.keep_from) as fh:
            old = json.load(fh)
        kept = [k for k in ("first_call", "under_jit", "dispatch", "changing_params",
                            "artifacts", "forward", "transformer", "first_program")
                if not res[k] and old.get(k)]
        for k in kept:
            res[k] = old[k]
            res.setdefault("kept_from", {})[k] = run_of(old, k)
    res["seconds"] = time.perf_counter() - t0
    name = a.name or ("calls_quick" if q else f"calls_{jax.default_backend()}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name + ".json"), "w") as fh:
        json.dump(res, fh, indent=1)
    with open(os.path.join(a.out, name + ".md"), "w") as fh:
        fh.write(to_markdown(res))
    log(f"wrote {os.path.join(a.out, name)}.json/.md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
