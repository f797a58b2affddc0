"""BatchNorm folding benchmark: Flax ResNet-18, ResNet-50 and MobileNetV2, unfolded vs hlofold
vs hand-folded ("ideal").

Run from the repository root::

    python -m benchmarks.run                      # full run: 3 models x batch 1, 8 at 224x224
    python -m benchmarks.run --quick --out /tmp/b # smoke run: tiny models, few rounds (~30 s)
    python -m benchmarks.run --models resnet50 --batch 1 8 32 --rounds 50

Models (``benchmarks/models.py``, Flax linen ``nn.Conv`` + ``nn.BatchNorm(use_running_average=True)``,
realistic random BN statistics): ``resnet18``, ``resnet50``, ``mobilenetv2`` (inverted
residuals, depthwise ``feature_group_count``); ``jax-resnet18``/``jax-resnet50`` are the
plain-JAX ResNets of ``hlofold.examples`` (the earlier benchmark, kept for comparison).

Variants (all timed in one process, interleaved round by round, rotating order):

  a   unfolded       jax.jit(model.apply)(variables, x)
  b   folded         hlofold.fold(jax.jit(model.apply))(variables, x)   params as inputs, cached prepare
  b'  folded-nocache same with cache_prepared=False (kernels rescaled in every call)
  c   frozen         hlofold.fold(model.apply, freeze=0)(variables, x)  params baked in as constants
  d   ideal          jax.jit(ideal_model.apply)(hand_folded, x)         use_bn=False: conv + bias

Writes ``{name}.json``, ``{name}.md`` and ``{name}.png`` into ``--out`` (default
``docs/benchmarks``; name default ``flax_{backend}``, ``flax_{backend}_quick`` with --quick).
The exit status is 1 when any variant of any model failed (the failure is in the outputs).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shlex
import sys
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import hlofold
from hlofold import _compat as C

from .common import (code_info, device_memory, error_text, loadavg, machine_info, machine_line,
                     now, rss_mb, summary, timed, version)
from .hlo_stats import count_eqns, hlo_counts, memory_stats
from .steady_report import (FLAX_MODELS, JAX_MODELS, RATIOS, TITLES, VARIANTS, assess,
                            render, summary_table, write_outputs)


# --------------------------------------------------------------------------- networks

@dataclasses.dataclass
class Net:
    """One benchmarked network: ``apply(variables, x)`` with BN, ``ideal_apply(ideal, x)``
    without (conv + bias on hand-folded parameters)."""
    key: str
    title: str
    apply: Callable
    ideal_apply: Callable
    variables: Any
    ideal: Any
    image_size: int
    dtype: Any
    blocks: list[str]
    info: dict

    def f(self):
        """A fresh Python function (no trace/compile cache shared with earlier ones)."""
        apply = self.apply
        return lambda variables, x: apply(variables, x)

    def f_ideal(self):
        apply = self.ideal_apply
        return lambda variables, x: apply(variables, x)


def build_net(key: str, args) -> Net:
    dtype = jnp.dtype(args.dtype)
    if key in FLAX_MODELS:
        from . import models as M
        width = args.mobilenet_width if key == "mobilenetv2" else args.resnet_width
        model, ideal_model, variables, ideal = M.build(
            key, image_size=args.image_size, num_classes=args.num_classes, width=width,
            dtype=dtype, seed=args.seed)
        num_bn = M.count_bn(variables)
        blocks = M.block_names(variables)
        apply, ideal_apply = model.apply, ideal_model.apply
        extra = {"library": f"flax.linen {version('flax')}",
                 ("width_mult" if key == "mobilenetv2" else "width"): width}
    elif key in JAX_MODELS:
        from hlofold.examples import count_bn, ideal_params, init_resnet, resnet_apply
        depth = int(key.split("resnet")[1])
        variables = init_resnet(depth, width=int(args.resnet_width),
                                num_classes=args.num_classes, seed=args.seed)
        ideal = jax.block_until_ready(ideal_params(variables))
        num_bn = count_bn(variables)
        blocks = [k for k in variables if k.startswith("stage")]
        apply, ideal_apply = resnet_apply, partial(resnet_apply, bn=False)
        extra = {"library": "plain JAX (hlofold.examples)", "width": int(args.resnet_width)}
        if dtype != jnp.float32:
            raise ValueError("the plain-JAX ResNets are float32 only")
    else:
        raise ValueError(f"unknown model {key!r}")
    info = {"num_bn": num_bn, "num_blocks": len(blocks), "image_size": args.image_size,
            "num_classes": args.num_classes, "dtype": str(dtype),
            "num_params": int(sum(np.size(l) for l in jax.tree.leaves(variables))),
            "param_mb": sum(l.nbytes for l in jax.tree.leaves(variables)) / 2 ** 20, **extra}
    return Net(key, TITLES[key], apply, ideal_apply, variables, ideal, args.image_size, dtype,
               blocks, info)


# --------------------------------------------------------------------------- variants

def make_variants(net: Net):
    """Per variant: a maker of a fresh callable (fresh Python function objects, so no
    trace/compile cache is shared with any earlier instance) and its parameters."""
    return {
        "a": lambda: (jax.jit(net.f()), net.variables),
        "b": lambda: (hlofold.fold(jax.jit(net.f())), net.variables),
        "b'": lambda: (hlofold.fold(jax.jit(net.f()), cache_prepared=False), net.variables),
        "c": lambda: (hlofold.fold(net.f(), freeze=0), net.variables),
        "d": lambda: (jax.jit(net.f_ideal()), net.ideal),
    }


def measure_compile(net: Net, x, reps: int, errors: dict):
    """Ahead-of-time compile timing, each rep with fresh function objects.

    a, d:   t(jax.jit(f).lower(params, x))  and  t(lowered.compile())
    c:      t(Folded.lower(params, x))  [trace + hlofold fold + lower, constants baked in]
            and t(lowered.compile())
    b:      t(Folded.split(params, x))  [trace + hlofold fold + host prepare]
            then lower + compile of the *apply* program (the one executable b runs; the
            prepare step runs on the host, without a compile).
    """
    out = {k: collections.defaultdict(list) for k in ("a", "b", "c", "d")}
    texts, mem = {}, {}
    extra = {}

    def guarded(name, fn):
        if name in errors:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
            errors[name] = error_text(e)

    for _ in range(reps):
        for name in ("a", "d"):
            def run(name=name):
                f = jax.jit(net.f() if name == "a" else net.f_ideal())
                p = net.variables if name == "a" else net.ideal
                t0 = now(); low = f.lower(p, x); t1 = now(); comp = low.compile(); t2 = now()
                out[name]["lower_s"].append(t1 - t0)
                out[name]["compile_s"].append(t2 - t1)
                texts[name], mem[name] = comp.as_text(), memory_stats(comp)
            guarded(name, run)

        def run_c():
            F = hlofold.fold(net.f(), freeze=0)
            t0 = now(); low = F.lower(net.variables, x); t1 = now(); comp = low.compile()
            t2 = now()
            out["c"]["lower_s"].append(t1 - t0)   # includes trace + fold
            out["c"]["compile_s"].append(t2 - t1)
            texts["c"], mem["c"] = comp.as_text(), memory_stats(comp)
        guarded("c", run_c)

        def run_b():
            F = hlofold.fold(jax.jit(net.f()))
            t0 = now(); sp = F.split(net.variables, x); t1 = now()
            out["b"]["split_s"].append(t1 - t0)   # trace + fold + host prepare
            for part, cj in (("apply", sp.apply_jaxpr),):
                avals = [C.shape_struct(a) for a in cj.in_avals]
                t0 = now(); low = jax.jit(C.jaxpr_as_fun(cj)).lower(*avals); t1 = now()
                comp = low.compile(); t2 = now()
                out["b"][f"{part}_lower_s"].append(t1 - t0)
                out["b"][f"{part}_compile_s"].append(t2 - t1)
                texts[f"b_{part}"], mem[f"b_{part}"] = comp.as_text(), memory_stats(comp)
            out["b"]["compile_s"].append(out["b"]["apply_compile_s"][-1])
            n_prep = len(sp.apply_jaxpr.jaxpr.invars) - len(sp.per_call)
            extra["prepared_mb"] = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                       for a in sp.apply_jaxpr.in_avals[:n_prep]) / 2 ** 20
            extra["prepared_from"] = len(sp.prepared_from)
        guarded("b", run_b)
    res = {k: {m: summary(v) for m, v in d.items()} for k, d in out.items() if d}
    counts = {k: hlo_counts(t) for k, t in texts.items()}
    return res, counts, mem, extra


def measure_fold(net: Net, x, reps: int) -> dict:
    """hlofold's own transformation time, separately from tracing: t(jax.make_jaxpr(f)) and
    t(hlofold.fold_jaxpr(closed_jaxpr)), each rep on a fresh function object."""
    trace, fold = [], []
    report = cj = None
    for _ in range(reps):
        f = net.f()
        t0 = now(); cj = jax.make_jaxpr(f)(net.variables, x); t1 = now()
        _, report = hlofold.fold_jaxpr(cj); t2 = now()
        trace.append(t1 - t0)
        fold.append(t2 - t1)
    return {"trace_s": summary(trace), "fold_jaxpr_s": summary(fold), "fold_jaxpr_all_s": fold,
            "jaxpr_eqns": count_eqns(cj.jaxpr), "report_counts": report.counts()}


def bench_batch(net: Net, batch, rounds, warmup, compile_reps, fold_reps, seed, log):
    x = jnp.asarray(np.random.default_rng(seed + batch).standard_normal(
        (batch, net.image_size, net.image_size, 3)).astype(np.float32))
    res: dict = {"model": net.key, "batch": batch, "image_size": net.image_size,
                 "loadavg_before": loadavg(), "errors": {}}
    errors = res["errors"]
    tag = f"[{net.key} batch {batch}]"

    # 1) transformation + compile costs (AOT, fresh objects each rep)
    log(f"{tag} fold timing ...")
    try:
        res["fold"] = measure_fold(net, x, fold_reps)
    except Exception as e:  # noqa: BLE001
        errors["fold"] = error_text(e)
    log(f"{tag} AOT compile timing ({compile_reps} reps) ...")
    res["compile"], res["hlo"], res["memory"], res["prepared"] = measure_compile(
        net, x, compile_reps, errors)

    # 2) first call (end-to-end: trace [+ fold + split] + compile + first run), fresh objects
    makers = make_variants(net)
    fns, first = {}, {}
    for name in VARIANTS:
        try:
            fn, p = makers[name]()
            dt, _ = timed(fn, p, x)
        except Exception as e:  # noqa: BLE001
            errors.setdefault(name, error_text(e))
            log(f"{tag} variant {name} FAILED: {errors[name].splitlines()[0]}")
            continue
        fns[name] = (fn, p)
        first[name] = dt
        log(f"{tag} first call {name:3s}: {dt:.3f}s")
    ok = [v for v in VARIANTS if v in fns]
    res["variants_run"] = ok

    # correctness vs a (or vs d when a failed)
    ref_name = "a" if "a" in fns else (ok[0] if ok else None)
    res["max_abs_diff_vs_a"] = {}
    if ref_name:
        ref = np.asarray(jax.block_until_ready(fns[ref_name][0](fns[ref_name][1], x)), np.float64)
        for name in ok:
            o = np.asarray(fns[name][0](fns[name][1], x), np.float64)
            res["max_abs_diff_vs_a"][name] = float(np.max(np.abs(o - ref)))
        res["max_abs_logit_a"] = float(np.max(np.abs(ref)))

    # 3) warm-up, then interleaved rounds with rotating order
    for _ in range(warmup):
        for name in ok:
            timed(fns[name][0], fns[name][1], x)
    times = {n: [] for n in ok}
    log(f"{tag} {rounds} interleaved rounds ...")
    for r in range(rounds):
        k = r % max(1, len(ok))
        for name in ok[k:] + ok[:k]:
            dt, _ = timed(fns[name][0], fns[name][1], x)
            times[name].append(dt)
    res["latency_s"] = {n: summary(v) for n, v in times.items() if v}
    res["latency_all_s"] = times
    res["ratios"] = {}
    for num, den in RATIOS:
        if times.get(num) and times.get(den):
            rr = [t / u for t, u in zip(times[num], times[den])]
            res["ratios"][f"{num}/{den}"] = summary(rr)
    res["first_call_s"] = first
    res["loadavg_after"] = loadavg()
    res["first_call_overhead_s"] = {n: first[n] - res["latency_s"][n]["median"]
                                    for n in ok if n in res["latency_s"]}
    if "fold" in res and "a" in res["compile"]:
        ca = res["compile"]["a"]["compile_s"]["median"]
        fm = res["fold"]["fold_jaxpr_s"]["median"]
        res["fold_vs_compile_a"] = {"fold_jaxpr_median_s": fm, "compile_a_median_s": ca,
                                    "percent": 100.0 * fm / ca,
                                    "percent_of_lower_plus_compile": 100.0 * fm / (
                                        ca + res["compile"]["a"]["lower_s"]["median"])}
    res["process_memory"] = rss_mb()
    res["device_memory"] = device_memory()
    del fns
    return res


# --------------------------------------------------------------------------- main

QUICK = {"image_size": 32, "resnet_width": 8, "mobilenet_width": 0.25, "num_classes": 10,
         "batch": [1], "rounds": 3, "warmup": 1, "compile_reps": 1, "fold_reps": 1}
# --quick only: cheap XLA:CPU code generation (HLO passes, so fusion counts, are unchanged),
# unless XLA_FLAGS is set. Recorded in the outputs like any XLA_FLAGS.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=FLAX_MODELS,
                    choices=FLAX_MODELS + JAX_MODELS)
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 8")
    ap.add_argument("--image-size", type=int, default=None, help="default 224")
    ap.add_argument("--resnet-width", type=int, default=None, help="ResNet base width (64)")
    ap.add_argument("--mobilenet-width", type=float, default=None,
                    help="MobileNetV2 width multiplier (1.0)")
    ap.add_argument("--num-classes", type=int, default=None, help="default 1000")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=None, help="default 30")
    ap.add_argument("--warmup", type=int, default=None, help="default 3")
    ap.add_argument("--compile-reps", type=int, default=None, help="default 3")
    ap.add_argument("--fold-reps", type=int, default=None, help="default 5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
                    + f" (explicit options still win); XLA_FLAGS={QUICK_XLA_FLAGS!r} "
                    "unless XLA_FLAGS is set")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default=None,
                    help="output file stem (default flax_{backend}[_quick])")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="only re-render the Markdown and PNG of an earlier run's JSON into "
                    "--out (stem from --name or the JSON's file name)")
    ap.add_argument("--note", default="", help="a line shown at the top of the Markdown "
                    "(e.g. that the machine was shared)")
    args = ap.parse_args(argv)
    full = {"image_size": 224, "resnet_width": 64, "mobilenet_width": 1.0, "num_classes": 1000,
            "batch": [1, 8], "rounds": 30, "warmup": 3, "compile_reps": 3, "fold_reps": 5}
    for k, v in (QUICK if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out, args.name)
    if args.quick and not os.environ.get("XLA_FLAGS"):
        os.environ["XLA_FLAGS"] = QUICK_XLA_FLAGS   # read when the backend starts (below)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = now()
    machine = machine_info()
    code = code_info()
    cfg = {k: getattr(args, k) for k in ("models", "batch", "image_size", "resnet_width",
                                         "mobilenet_width", "num_classes", "dtype", "rounds",
                                         "warmup", "compile_reps", "fold_reps", "seed", "quick",
                                         "note")}
    log(f"machine: {machine_line(machine)}")
    models = []
    for key in args.models:
        entry: dict = {"key": key, "title": TITLES[key], "batches": []}
        try:
            net = build_net(key, args)
        except Exception as e:  # noqa: BLE001
            entry.update(error=error_text(e), info={}, blocks=[])
            log(f"[{key}] build FAILED: {entry['error']}")
            models.append(entry)
            continue
        entry.update(info=net.info, blocks=net.blocks)
        log(f"[{key}] {net.info['num_bn']} BNs, {net.info['num_blocks']} blocks, "
            f"{net.info['num_params'] / 1e6:.2f} M params")
        for b in args.batch:
            res = bench_batch(net, b, args.rounds, args.warmup, args.compile_reps,
                              args.fold_reps, args.seed, log)
            res["_num_blocks"] = len(net.blocks)
            entry["batches"].append(res)
        models.append(entry)
        del net
    argv_s = argv if argv is not None else sys.argv[1:]
    cmdline = ("python -m benchmarks.run " + shlex.join(argv_s)).strip()
    result = {"machine": machine, "code": code, "config": cfg, "models": models,
              "command": cmdline, "total_runtime_s": now() - t_start,
              "process_memory": rss_mb(), "device_memory": device_memory()}
    result["assessment"] = assess(result)
    failed = any(mk.get("error") or any(b["errors"] for b in mk["batches"]) for mk in models)
    result["failed"] = failed

    stem = args.name or f"flax_{machine['backend']}" + ("_quick" if args.quick else "")
    png = write_outputs(result, args.out, stem, not args.no_plot)
    print("\n".join(summary_table(result)))
    log(f"wrote {os.path.join(args.out, stem)}.json/.md" + ("/.png" if png else "")
        + f" in {result['total_runtime_s']:.0f} s" + (" (WITH FAILURES)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
