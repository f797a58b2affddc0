"""ResNet benchmark: unfolded vs hlofold-folded vs hand-folded ("ideal") BatchNorm.

Run from the repository root::

    python -m benchmarks.run [--depth 50] [--batch 1 8] [--rounds 30] [--out docs/benchmarks]

Variants (all timed in one process, interleaved round by round, rotating order):

  a   unfolded      jax.jit(resnet_apply)(params, x)
  b   folded        hlofold.fold(jax.jit(resnet_apply))(params, x)   params as inputs, cached prepare
  b'  folded-nocache same with cache_prepared=False (kernels rescaled in every call)
  c   frozen        hlofold.fold(resnet_apply, freeze=0)(params, x)  params baked in as constants
  d   ideal         jax.jit(partial(resnet_apply, bn=False))(ideal_params(params), x)

Writes ``resnet{depth}_{backend}.json`` and ``.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import hlofold
from hlofold import _compat as C
from hlofold.examples import count_bn, ideal_params, init_resnet, resnet_apply

VARIANTS = ["a", "b", "b'", "c", "d"]
LABELS = {
    "a": "unfolded: jax.jit(resnet_apply)",
    "b": "hlofold.fold(jit(f)), params as inputs, cached prepare",
    "b'": "hlofold.fold(jit(f), cache_prepared=False)",
    "c": "hlofold.fold(f, freeze=0) (params frozen)",
    "d": "ideal: jit(f, bn=False) on hand-folded params",
}
RATIOS = [("b", "a"), ("b'", "a"), ("c", "a"), ("b", "d"), ("c", "d")]


# --------------------------------------------------------------------------- helpers

def _now() -> float:
    return time.perf_counter()


def _timed(fn, *args):
    t0 = _now()
    out = jax.block_until_ready(fn(*args))
    return _now() - t0, out


def _summ(xs) -> dict:
    xs = list(xs)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _loadavg():
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def code_info() -> dict:
    """Which hlofold was measured: git commit, whether hlofold/ differs from it, and a hash
    of the imported hlofold sources (the repository may change between runs)."""
    import hashlib
    import subprocess
    pkg = os.path.dirname(hlofold.__file__)
    h = hashlib.sha256()
    for fn in sorted(os.listdir(pkg)):
        if fn.endswith(".py"):
            with open(os.path.join(pkg, fn), "rb") as f:
                h.update(fn.encode() + b"\0" + f.read())
    info = {"hlofold_path": pkg, "hlofold_sources_sha256": h.hexdigest()[:16]}
    try:
        root = os.path.dirname(pkg)
        git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True,
                                        text=True, timeout=10).stdout.strip()  # noqa: E731
        info["git_commit"] = git("rev-parse", "--short", "HEAD") or None
        info["hlofold_dirty"] = bool(git("status", "--porcelain", "--", "hlofold"))
    except Exception:  # pragma: no cover
        pass
    return info


def machine_info() -> dict:
    cpu = None
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if cpu is None and line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                if not flags and line.startswith("flags"):
                    flags = line.split(":", 1)[1]
    except OSError:
        pass
    try:
        import jaxlib
        jaxlib_version = getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
    except Exception:  # pragma: no cover
        jaxlib_version = None
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f} " in f" {flags} "]
    return {
        "cpu_model": cpu or platform.processor(),
        "cpu_isa": isa,
        "os_cpu_count": os.cpu_count(),
        "sched_affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib_version,
        "hlofold": hlofold.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------- HLO counting

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
_KIND = re.compile(r"\bkind=(k\w+)")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_TRIVIAL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def hlo_counts(text: str) -> dict:
    """Counts from the optimized (post-XLA-pipeline) HLO text of a compiled executable.

    Method: parse every instruction line ``%name = <shape> <opcode>(...)`` and attribute it to
    the computation it is in. ``fusions`` = instructions with opcode ``fusion`` anywhere in
    the module (by ``kind=``); ``entry_ops`` = instructions of the ENTRY computation other
    than parameter/constant/bitcast/get-tuple-element/tuple (≈ the kernels the runtime
    launches); ``convolutions`` = ``convolution`` instructions anywhere (inside fusions too).
    """
    comp = None
    entry_ops = collections.Counter()
    all_ops = collections.Counter()
    fusion_kinds = collections.Counter()
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = "ENTRY" if m.group(1) else m.group(2)
            continue
        if line.startswith("}"):
            comp = None
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        op = m.group(2)
        all_ops[op] += 1
        if comp == "ENTRY":
            entry_ops[op] += 1
        if op == "fusion":
            k = _KIND.search(line)
            fusion_kinds[k.group(1) if k else "?"] += 1
    nontrivial = {k: v for k, v in entry_ops.items() if k not in _TRIVIAL}
    return {
        "fusions": sum(fusion_kinds.values()),
        "fusion_kinds": dict(sorted(fusion_kinds.items())),
        "entry_ops": sum(nontrivial.values()),
        "entry_op_histogram": dict(sorted(nontrivial.items(), key=lambda kv: -kv[1])),
        "convolutions": all_ops.get("convolution", 0),
        "constants_in_entry": entry_ops.get("constant", 0),
        "parameters": entry_ops.get("parameter", 0),
        "hlo_lines": text.count("\n") + 1,
    }


# --------------------------------------------------------------------------- variants

def make_variants(params, ideal):
    """Fresh callables (fresh Python function objects, so no trace/compile cache is shared
    with any earlier instance) and their arguments, per variant."""
    def fresh_f():
        return lambda p, x: resnet_apply(p, x)

    def fresh_ideal():
        return lambda p, x: resnet_apply(p, x, bn=False)

    return {
        "a": lambda: (jax.jit(fresh_f()), params, False),
        "b": lambda: (hlofold.fold(jax.jit(fresh_f())), params, False),
        "b'": lambda: (hlofold.fold(jax.jit(fresh_f()), cache_prepared=False), params, False),
        "c": lambda: (hlofold.fold(fresh_f(), freeze=0), params, False),
        "d": lambda: (jax.jit(fresh_ideal()), ideal, True),
    }


def measure_compile(params, ideal, x, reps: int) -> dict:
    """Ahead-of-time compile timing, each rep with fresh function objects.

    a, d:   t(jax.jit(f).lower(params, x))  and  t(lowered.compile())
    c:      t(Folded.lower(params, x))  [trace + hlofold fold + lower, constants baked in]
            and t(lowered.compile())
    b:      t(Folded.split(params, x))  [trace + hlofold fold + prepare/apply partial eval]
            then lower + compile of the *apply* program and of the *prepare* program
            (the two executables b actually runs).
    """
    out = {k: collections.defaultdict(list) for k in ("a", "b", "c", "d")}
    texts = {}
    for r in range(reps):
        for name in ("a", "d"):
            f = jax.jit(lambda p, x: resnet_apply(p, x)) if name == "a" else \
                jax.jit(lambda p, x: resnet_apply(p, x, bn=False))
            args = (params if name == "a" else ideal, x)
            t0 = _now(); low = f.lower(*args); t1 = _now(); comp = low.compile(); t2 = _now()
            out[name]["lower_s"].append(t1 - t0)
            out[name]["compile_s"].append(t2 - t1)
            texts[name] = comp.as_text()
        F = hlofold.fold(lambda p, x: resnet_apply(p, x), freeze=0)
        t0 = _now(); low = F.lower(params, x); t1 = _now(); comp = low.compile(); t2 = _now()
        out["c"]["lower_s"].append(t1 - t0)   # includes trace + fold
        out["c"]["compile_s"].append(t2 - t1)
        texts["c"] = comp.as_text()
        F = hlofold.fold(jax.jit(lambda p, x: resnet_apply(p, x)))
        t0 = _now(); sp = F.split(params, x); t1 = _now()
        out["b"]["split_s"].append(t1 - t0)   # trace + fold + partial eval
        for part, cj in (("apply", sp.apply_jaxpr), ("prepare", sp.prepare_jaxpr)):
            avals = [C.shape_struct(a) for a in cj.in_avals]
            t0 = _now(); low = jax.jit(C.jaxpr_as_fun(cj)).lower(*avals); t1 = _now()
            comp = low.compile(); t2 = _now()
            out["b"][f"{part}_lower_s"].append(t1 - t0)
            out["b"][f"{part}_compile_s"].append(t2 - t1)
            texts[f"b_{part}"] = comp.as_text()
        out["b"]["compile_s"].append(out["b"]["apply_compile_s"][-1]
                                     + out["b"]["prepare_compile_s"][-1])
    res = {k: {m: _summ(v) for m, v in d.items()} for k, d in out.items()}
    counts = {k: hlo_counts(t) for k, t in texts.items()}
    return res, counts


def measure_fold(params, x, reps: int) -> dict:
    """hlofold's own transformation time, separately from tracing: t(jax.make_jaxpr(f)) and
    t(hlofold.fold_jaxpr(closed_jaxpr)), each rep on a fresh function object."""
    trace, fold = [], []
    report = None
    for _ in range(reps):
        f = lambda p, x: resnet_apply(p, x)  # noqa: E731  (fresh: no trace cache hit)
        t0 = _now(); cj = jax.make_jaxpr(f)(params, x); t1 = _now()
        _, report = hlofold.fold_jaxpr(cj); t2 = _now()
        trace.append(t1 - t0)
        fold.append(t2 - t1)
    return {"trace_s": _summ(trace), "fold_jaxpr_s": _summ(fold), "fold_jaxpr_all_s": fold,
            "jaxpr_eqns": len(cj.jaxpr.eqns), "report_counts": report.counts()}


def bench_batch(params, ideal, batch, image, rounds, warmup, compile_reps, fold_reps, seed,
                log):
    x = jnp.asarray(np.random.default_rng(seed + batch).standard_normal(
        (batch, image, image, 3)).astype(np.float32))
    res: dict = {"batch": batch, "image_size": image, "loadavg_before": _loadavg()}

    # 1) transformation + compile costs (AOT, fresh objects each rep)
    log(f"[batch {batch}] fold timing ...")
    res["fold"] = measure_fold(params, x, fold_reps)
    log(f"[batch {batch}] AOT compile timing ({compile_reps} reps) ...")
    res["compile"], res["hlo"] = measure_compile(params, ideal, x, compile_reps)

    # 2) first call (end-to-end: trace [+ fold + split] + compile + first run), fresh objects
    makers = make_variants(params, ideal)
    fns, first = {}, {}
    for name in VARIANTS:
        fn, p, _ = makers[name]()
        dt, out = _timed(fn, p, x)
        fns[name] = (fn, p)
        first[name] = dt
        log(f"[batch {batch}] first call {name:3s}: {dt:.3f}s")

    # correctness vs a
    ref = np.asarray(jax.block_until_ready(fns["a"][0](fns["a"][1], x)))
    res["max_abs_diff_vs_a"] = {}
    for name in VARIANTS:
        o = np.asarray(fns[name][0](fns[name][1], x))
        res["max_abs_diff_vs_a"][name] = float(np.max(np.abs(o - ref)))
    res["max_abs_logit_a"] = float(np.max(np.abs(ref)))

    # 3) warm-up, then interleaved rounds with rotating order
    for _ in range(warmup):
        for name in VARIANTS:
            _timed(fns[name][0], fns[name][1], x)
    times = {n: [] for n in VARIANTS}
    log(f"[batch {batch}] {rounds} interleaved rounds ...")
    for r in range(rounds):
        k = r % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]
        for name in order:
            dt, _ = _timed(fns[name][0], fns[name][1], x)
            times[name].append(dt)
    res["latency_s"] = {n: _summ(v) for n, v in times.items()}
    res["latency_all_s"] = times
    res["ratios"] = {}
    for num, den in RATIOS:
        rr = [t / u for t, u in zip(times[num], times[den])]
        res["ratios"][f"{num}/{den}"] = _summ(rr)
    res["first_call_s"] = first
    res["loadavg_after"] = _loadavg()
    res["first_call_overhead_s"] = {n: first[n] - res["latency_s"][n]["median"]
                                    for n in VARIANTS}
    ca = res["compile"]["a"]["compile_s"]["median"]
    fm = res["fold"]["fold_jaxpr_s"]["median"]
    res["fold_vs_compile_a"] = {"fold_jaxpr_median_s": fm, "compile_a_median_s": ca,
                                "percent": 100.0 * fm / ca,
                                "percent_of_lower_plus_compile": 100.0 * fm / (
                                    ca + res["compile"]["a"]["lower_s"]["median"])}
    return res


# --------------------------------------------------------------------------- markdown

def _ms(s):
    return f"{1e3 * s:.1f}"


def to_markdown(result: dict, cmdline: str) -> str:
    m, cfg = result["machine"], result["config"]
    L = []
    L.append(f"# ResNet-{cfg['depth']} BatchNorm folding benchmark ({m['backend'].upper()})\n")
    L.append(f"Command: `{cmdline}`\n")
    L.append(f"- Machine: {m['cpu_model']} ({', '.join(m['cpu_isa']) or 'no AVX2/AVX-512 flags'}), "
             f"{m['sched_affinity_cpus']} usable cores (os.cpu_count={m['os_cpu_count']}), "
             f"{m['platform']}")
    L.append(f"- Software: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
             f"hlofold {m['hlofold']}; XLA_FLAGS=`{m['XLA_FLAGS'] or '(unset)'}`")
    L.append(f"- Date (UTC): {m['date_utc']}")
    c = result.get("code", {})
    L.append(f"- Code: git {c.get('git_commit')}"
             + (" with uncommitted changes in hlofold/" if c.get("hlofold_dirty") else "")
             + f", hlofold sources sha256 {c.get('hlofold_sources_sha256')}")
    L.append(f"- Network: ResNet-{cfg['depth']}, width {cfg['width']}, {cfg['num_classes']} classes, "
             f"{cfg['num_bn']} BatchNorms, float32, NHWC {cfg['image_size']}x{cfg['image_size']}x3"
             + ("" if cfg["image_size"] == 224 else
                f" (**adjusted from 224 to {cfg['image_size']}**)"))
    L.append(f"- Timing: {cfg['warmup']} warm-up calls per variant, then {cfg['rounds']} rounds; each "
             "round calls every variant once, in an order rotated by one each round; every call is "
             "wall-clock `time.perf_counter` around `jax.block_until_ready(f(params, x))` in one process. "
             "Ratios are computed per round (same round numerator/denominator) and summarised as "
             "median [min–max].")
    L.append("")
    L.append("Variants:\n")
    for v in VARIANTS:
        L.append(f"- **({v})** {LABELS[v]}")
    L.append("")
    for b in result["batches"]:
        lat = b["latency_s"]
        L.append(f"## Batch {b['batch']}\n")
        L.append("| variant | median ms | min–max ms | first call s | max abs diff vs (a) |")
        L.append("|---|---:|---:|---:|---:|")
        for v in VARIANTS:
            s = lat[v]
            L.append(f"| ({v}) {LABELS[v]} | {_ms(s['median'])} | {_ms(s['min'])}–{_ms(s['max'])} | "
                     f"{b['first_call_s'][v]:.2f} | {b['max_abs_diff_vs_a'][v]:.1e} |")
        L.append(f"\n(max |logit| of (a): {b['max_abs_logit_a']:.1f}, so the largest relative "
                 f"difference is {max(b['max_abs_diff_vs_a'].values()) / b['max_abs_logit_a']:.1e}; "
                 f"1-min load average before/after this batch: {b['loadavg_before']} / "
                 f"{b['loadavg_after']})\n")
        L.append("| per-round ratio | median | min–max |")
        L.append("|---|---:|---:|")
        for k, s in b["ratios"].items():
            L.append(f"| ({k.split('/')[0]})/({k.split('/')[1]}) | {s['median']:.3f} | "
                     f"{s['min']:.3f}–{s['max']:.3f} |")
        c = b["compile"]
        L.append("\nCompile / transform cost (median of "
                 f"{cfg['compile_reps']} AOT reps, fresh function objects each rep):\n")
        L.append("| program | trace+lower s | XLA compile s |")
        L.append("|---|---:|---:|")
        L.append(f"| (a) unfolded | {c['a']['lower_s']['median']:.3f} | {c['a']['compile_s']['median']:.3f} |")
        L.append(f"| (d) ideal | {c['d']['lower_s']['median']:.3f} | {c['d']['compile_s']['median']:.3f} |")
        L.append(f"| (c) frozen (`Folded.lower` incl. trace+fold; then `.compile()`) | "
                 f"{c['c']['lower_s']['median']:.3f} | {c['c']['compile_s']['median']:.3f} |")
        L.append(f"| (b) `Folded.split` (trace+fold+partial eval), apply program | "
                 f"{c['b']['split_s']['median']:.3f} + {c['b']['apply_lower_s']['median']:.3f} | "
                 f"{c['b']['apply_compile_s']['median']:.3f} |")
        L.append(f"| (b) prepare program | {c['b']['prepare_lower_s']['median']:.3f} | "
                 f"{c['b']['prepare_compile_s']['median']:.3f} |")
        f = b["fold"]
        fv = b["fold_vs_compile_a"]
        L.append(f"\nhlofold transform alone: `hlofold.fold_jaxpr(jax.make_jaxpr(f)(params, x))` "
                 f"= **{1e3 * f['fold_jaxpr_s']['median']:.1f} ms** median "
                 f"({1e3 * f['fold_jaxpr_s']['min']:.1f}–{1e3 * f['fold_jaxpr_s']['max']:.1f} ms, "
                 f"{f['fold_jaxpr_s']['n']} reps; jaxpr of {f['jaxpr_eqns']} equations; "
                 f"tracing itself {1e3 * f['trace_s']['median']:.1f} ms, not included). "
                 f"Relative to XLA compile of (a) ({fv['compile_a_median_s']:.3f} s): "
                 f"**{fv['percent']:.1f}%** (of lower+compile: {fv['percent_of_lower_plus_compile']:.1f}%). "
                 f"Fold report: {f['report_counts']}.\n")
        L.append("First-call overhead (first call − steady-state median; includes trace, "
                 "hlofold fold/split where applicable, XLA compile(s), prepare run, first run): "
                 + ", ".join(f"({v}) {b['first_call_overhead_s'][v]:.2f} s" for v in VARIANTS) + "\n")
        h = b["hlo"]
        L.append("Optimized HLO (`jax.jit(...).lower(...).compile().as_text()`):\n")
        L.append("| program | fusions (by kind) | entry ops (non-trivial) | convolutions | entry constants |")
        L.append("|---|---:|---:|---:|---:|")
        for key, name in (("a", "(a) unfolded"), ("b_apply", "(b) apply program"),
                          ("b_prepare", "(b) prepare program"), ("c", "(c) frozen"),
                          ("d", "(d) ideal")):
            hh = h[key]
            kinds = ", ".join(f"{k}:{v}" for k, v in hh["fusion_kinds"].items())
            L.append(f"| {name} | {hh['fusions']} ({kinds}) | {hh['entry_ops']} | "
                     f"{hh['convolutions']} | {hh['constants_in_entry']} |")
        L.append("")
    L.append("Counting method: every HLO instruction line `%name = <shape> <opcode>(…)` is parsed; "
             "*fusions* counts opcode `fusion` anywhere in the module; *entry ops* counts ENTRY "
             "instructions except parameter/constant/bitcast/get-tuple-element/tuple (≈ kernels "
             "launched); *convolutions* counts opcode `convolution` anywhere, including inside "
             "fused computations.\n")
    L.append("Compile-time method: (a),(d): `jax.jit(f).lower(params, x)` then `.compile()`, timed "
             "separately. (c): `Folded.lower(params, x)` (trace + fold + lower) then `.compile()`. "
             "(b): `Folded.split(params, x)` (trace + fold + prepare/apply split) then lower and "
             "compile of the apply and prepare jaxprs, which are the two executables (b) runs. "
             "Each rep uses fresh Python function objects so no JAX trace/compile cache is hit.\n")
    return "\n".join(L)


def assess(result: dict) -> list[str]:
    lines = []
    for b in result["batches"]:
        for v in ("b", "c"):
            r = b["ratios"][f"{v}/a"]
            la, lv = b["latency_s"]["a"]["median"], b["latency_s"][v]["median"]
            ok_lat, ok_ratio = lv <= la, r["median"] <= 1.0
            verdict = ("meets target ≤ (a) on both." if ok_lat and ok_ratio else
                       "**falls short of target ≤ (a) on both.**" if not (ok_lat or ok_ratio) else
                       "**mixed**: " + ("median latency meets, " if ok_lat else
                                        "median latency falls short, ")
                       + ("per-round ratio meets." if ok_ratio else "per-round ratio falls short."))
            lines.append(f"- batch {b['batch']}: ({v}) median latency {1e3 * lv:.2f} ms vs (a) {1e3 * la:.2f} ms; "
                         f"per-round ratio ({v})/(a) median {r['median']:.3f} "
                         f"[{r['min']:.3f}–{r['max']:.3f}]: " + verdict)
        fv = b["fold_vs_compile_a"]
        lines.append(f"- batch {b['batch']}: fold time {1e3 * fv['fold_jaxpr_median_s']:.1f} ms = "
                     f"{fv['percent']:.1f}% of (a) XLA compile {fv['compile_a_median_s']:.3f} s: "
                     + ("meets target < 5%." if fv["percent"] < 5 else
                        "**falls short of target < 5%.**"))
    return lines


# --------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile-reps", type=int, default=3)
    ap.add_argument("--fold-reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default=None, help="output file stem (default resnet{depth}_{backend})")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = _now()
    params = init_resnet(args.depth, width=args.width, num_classes=args.num_classes,
                         seed=args.seed)
    ideal = jax.block_until_ready(ideal_params(params))
    machine = machine_info()
    code = code_info()
    cfg = {"depth": args.depth, "width": args.width, "num_classes": args.num_classes,
           "num_bn": count_bn(params), "image_size": args.image_size, "batches": args.batch,
           "rounds": args.rounds, "warmup": args.warmup, "compile_reps": args.compile_reps,
           "fold_reps": args.fold_reps, "seed": args.seed,
           "num_params": int(sum(np.size(l) for l in jax.tree.leaves(params)))}
    log(f"machine: {machine['cpu_model']}, {machine['sched_affinity_cpus']} cores, "
        f"jax {machine['jax']}")
    batches = [bench_batch(params, ideal, b, args.image_size, args.rounds, args.warmup,
                           args.compile_reps, args.fold_reps, args.seed, log)
               for b in args.batch]
    cmdline = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"machine": machine, "code": code, "config": cfg, "batches": batches,
              "command": cmdline.strip(), "total_runtime_s": None}
    result["total_runtime_s"] = _now() - t_start
    result["assessment"] = assess(result)

    os.makedirs(args.out, exist_ok=True)
    stem = args.name or f"resnet{args.depth}_{machine['backend']}"
    md = to_markdown(result, cmdline.strip())
    md += "\n## Targets\n\n" + "\n".join(result["assessment"]) + "\n"
    md += f"\nTotal benchmark runtime: {result['total_runtime_s']:.0f} s.\n"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(md)
    print(md)
    log(f"wrote {os.path.join(args.out, stem)}.json/.md in {result['total_runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
