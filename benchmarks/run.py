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
import datetime
import json
import os
import platform
import re
import resource
import shlex
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import hlofold
from hlofold import _compat as C

VARIANTS = ["a", "b", "b'", "c", "d"]
LABELS = {
    "a": "unfolded: jax.jit(model.apply)",
    "b": "hlofold.fold(jax.jit(model.apply)), params as inputs, cached prepare",
    "b'": "hlofold.fold(jax.jit(model.apply), cache_prepared=False)",
    "c": "hlofold.fold(model.apply, freeze=0) (params frozen)",
    "d": "ideal: jax.jit(model_without_bn.apply) on hand-folded params",
}
SHORT = {"a": "unfolded", "b": "folded", "b'": "folded, no cache", "c": "frozen",
         "d": "ideal (no BN)"}
RATIOS = [("b", "a"), ("b'", "a"), ("c", "a"), ("d", "a"), ("b", "d"), ("c", "d")]
PROGRAMS = [("a", "(a) unfolded"), ("b_apply", "(b) apply program"), ("c", "(c) frozen"),
            ("d", "(d) ideal")]
FLAX_MODELS = ["resnet18", "resnet50", "mobilenetv2"]
JAX_MODELS = ["jax-resnet18", "jax-resnet50"]
TITLES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50", "mobilenetv2": "MobileNetV2",
          "jax-resnet18": "ResNet-18 (plain JAX)", "jax-resnet50": "ResNet-50 (plain JAX)"}


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


def _rss_mb() -> dict:
    """Process memory: current RSS (/proc/self/statm) and peak RSS (getrusage ru_maxrss)."""
    cur = None
    try:
        with open("/proc/self/statm") as f:
            cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"rss_mb": cur, "peak_rss_mb": peak}


def _device_memory() -> dict | None:
    try:
        st = jax.devices()[0].memory_stats()
    except Exception:  # pragma: no cover
        st = None
    if not st:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(st[k]) for k in keep if k in st}


def _err(e: BaseException) -> str:
    tb = [l for l in traceback.format_exception(type(e), e, e.__traceback__)
          if l.startswith("  File")]
    own = [l for l in tb if "site-packages" not in l]
    frames = own[-3:] + ([tb[-1]] if tb and tb[-1] not in own[-3:] else [])
    return f"{type(e).__name__}: {str(e)[:300]}\n" + "".join(frames)


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
        git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True,  # noqa: E731
                                        text=True, timeout=10).stdout.strip()
        info["git_commit"] = git("rev-parse", "--short", "HEAD") or None
        info["hlofold_dirty"] = bool(git("status", "--porcelain", "--", "hlofold"))
        info["benchmarks_dirty"] = bool(git("status", "--porcelain", "--", "benchmarks"))
    except Exception:  # pragma: no cover
        pass
    return info


def _version(mod: str):
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


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
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f} " in f" {flags} "]
    dev = jax.devices()[0]
    return {
        "cpu_model": cpu or platform.processor() or platform.machine(),
        "cpu_isa": isa,
        "os_cpu_count": os.cpu_count(),
        "sched_affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "numpy": np.__version__,
        "hlofold": hlofold.__version__,
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "devices": [str(d) for d in jax.devices()],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    return (f"{m['cpu_model']}, {m['sched_affinity_cpus']} usable cores; device "
            f"{m['backend']}:{m['device_kind']}; jax {m['jax']}, jaxlib {m['jaxlib']}, "
            f"flax {m['flax']}, hlofold {m['hlofold']}")


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
        extra = {"library": f"flax.linen {_version('flax')}",
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


# --------------------------------------------------------------------------- HLO counting

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
_KIND = re.compile(r"\bkind=(k\w+)")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_BLOCK = re.compile(r"/((?:stage\d+_)?block\d+)/")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)")
_TRIVIAL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}
CUDNN_BIAS_ACT = "__cudnn$convBiasActivationForward"


def hlo_counts(text: str) -> dict:
    """Counts from the optimized (post-XLA-pipeline) HLO text of a compiled executable.

    Method: parse every instruction line ``%name = <shape> <opcode>(...)`` and attribute it to
    the computation it is in. ``fusions`` = instructions with opcode ``fusion`` anywhere in
    the module (by ``kind=``); ``entry_ops`` = instructions of the ENTRY computation other
    than parameter/constant/bitcast/get-tuple-element/tuple (≈ the kernels the runtime
    launches); ``convolutions`` = ``convolution`` instructions anywhere (inside fusions too);
    ``custom_call_targets`` = targets of ``custom-call`` instructions (on GPU, cuDNN
    convolutions are ``__cudnn$convForward`` and, fused with bias and activation,
    ``__cudnn$convBiasActivationForward``).

    Per residual block: an ENTRY instruction belongs to the block named in its own
    ``op_name`` metadata (for a fusion, that of its root), i.e. containing
    ``/stage<s>_block<i>/`` or ``/block<i>/``. ``fusions_per_block`` counts ENTRY fusions,
    ``kernels_per_block`` all non-trivial ENTRY instructions, per block; each is counted
    once. ``multi_block_fusions``: ENTRY fusions whose fused computation (recursively)
    holds ops of more than one block; ``spanning_fusions``: ENTRY fusions whose root is in
    no block but whose body holds ops of blocks (XLA:CPU's YNNPACK fusions can take in
    whole stages and end in the head's reduction), with ``blocks_in_spanning_fusions`` the
    number of blocks they take in.
    """
    comp = None
    comps: dict[str, list] = collections.defaultdict(list)   # comp -> [(op, blocks, calls)]
    entry_ops = collections.Counter()
    all_ops = collections.Counter()
    fusion_kinds = collections.Counter()
    targets = collections.Counter()
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
        if op == "custom-call":
            t = _TARGET.search(line)
            targets[t.group(1) if t else "?"] += 1
        if op == "fusion":
            k = _KIND.search(line)
            fusion_kinds[k.group(1) if k else "?"] += 1
        n = _OPNAME.search(line)
        blocks = frozenset(_BLOCK.findall(n.group(1))[-1:]) if n else frozenset()
        calls = []
        for c in _CALLS.findall(line):
            calls.extend(x.strip().lstrip("%") for x in c.split(","))
        comps[comp].append((op, blocks, calls))

    memo: dict[str, frozenset] = {}

    def comp_blocks(name: str, depth: int = 0) -> frozenset:
        if name in memo or depth > 50:
            return memo.get(name, frozenset())
        memo[name] = frozenset()   # cycle guard
        out = set()
        for _, bl, calls in comps.get(name, ()):
            out |= bl
            for c in calls:
                out |= comp_blocks(c, depth + 1)
        memo[name] = frozenset(out)
        return memo[name]

    fusions_pb, kernels_pb = collections.Counter(), collections.Counter()
    multi = entry_fusions = spanning = 0
    spanned: set = set()
    for op, bl, calls in comps.get("ENTRY", ()):
        if op in _TRIVIAL:
            continue
        touched = set(bl)
        for c in calls:
            touched |= comp_blocks(c)
        for b in bl:
            kernels_pb[b] += 1
            if op == "fusion":
                fusions_pb[b] += 1
        if op == "fusion":
            entry_fusions += 1
            multi += len(touched) > 1
            if not bl and touched:
                spanning += 1
                spanned |= touched
    nontrivial = {k: v for k, v in entry_ops.items() if k not in _TRIVIAL}
    return {
        "fusions": sum(fusion_kinds.values()),
        "fusion_kinds": dict(sorted(fusion_kinds.items())),
        "entry_fusions": entry_fusions,
        "fusions_per_block": dict(fusions_pb),
        "fusions_in_blocks": sum(fusions_pb.values()),
        "kernels_per_block": dict(kernels_pb),
        "multi_block_fusions": multi,
        "spanning_fusions": spanning,
        "blocks_in_spanning_fusions": len(spanned),
        "spanned_blocks": sorted(spanned),
        "entry_ops": sum(nontrivial.values()),
        "entry_op_histogram": dict(sorted(nontrivial.items(), key=lambda kv: -kv[1])),
        "convolutions": all_ops.get("convolution", 0),
        "custom_call_targets": dict(targets),
        "cudnn_convs": sum(v for k, v in targets.items() if k.startswith("__cudnn$conv")),
        "cudnn_conv_bias_activation": targets.get(CUDNN_BIAS_ACT, 0),
        "constants_in_entry": entry_ops.get("constant", 0),
        "parameters": entry_ops.get("parameter", 0),
        "hlo_lines": text.count("\n") + 1,
    }


def memory_stats(compiled) -> dict | None:
    """``compiled.memory_analysis()`` in bytes: arguments, outputs, temporaries (XLA's
    buffer assignment), generated code, and ``peak_memory_in_bytes`` where the backend
    reports it."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # pragma: no cover
        return None
    if ma is None:
        return None
    out = {}
    for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes"):
        v = getattr(ma, k, None)
        if v is not None:
            out[k.replace("_in_bytes", "")] = int(v)
    return out


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
            errors[name] = _err(e)

    for _ in range(reps):
        for name in ("a", "d"):
            def run(name=name):
                f = jax.jit(net.f() if name == "a" else net.f_ideal())
                p = net.variables if name == "a" else net.ideal
                t0 = _now(); low = f.lower(p, x); t1 = _now(); comp = low.compile(); t2 = _now()
                out[name]["lower_s"].append(t1 - t0)
                out[name]["compile_s"].append(t2 - t1)
                texts[name], mem[name] = comp.as_text(), memory_stats(comp)
            guarded(name, run)

        def run_c():
            F = hlofold.fold(net.f(), freeze=0)
            t0 = _now(); low = F.lower(net.variables, x); t1 = _now(); comp = low.compile()
            t2 = _now()
            out["c"]["lower_s"].append(t1 - t0)   # includes trace + fold
            out["c"]["compile_s"].append(t2 - t1)
            texts["c"], mem["c"] = comp.as_text(), memory_stats(comp)
        guarded("c", run_c)

        def run_b():
            F = hlofold.fold(jax.jit(net.f()))
            t0 = _now(); sp = F.split(net.variables, x); t1 = _now()
            out["b"]["split_s"].append(t1 - t0)   # trace + fold + host prepare
            for part, cj in (("apply", sp.apply_jaxpr),):
                avals = [C.shape_struct(a) for a in cj.in_avals]
                t0 = _now(); low = jax.jit(C.jaxpr_as_fun(cj)).lower(*avals); t1 = _now()
                comp = low.compile(); t2 = _now()
                out["b"][f"{part}_lower_s"].append(t1 - t0)
                out["b"][f"{part}_compile_s"].append(t2 - t1)
                texts[f"b_{part}"], mem[f"b_{part}"] = comp.as_text(), memory_stats(comp)
            out["b"]["compile_s"].append(out["b"]["apply_compile_s"][-1])
            n_prep = len(sp.apply_jaxpr.jaxpr.invars) - len(sp.per_call)
            extra["prepared_mb"] = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                       for a in sp.apply_jaxpr.in_avals[:n_prep]) / 2 ** 20
            extra["prepared_from"] = len(sp.prepared_from)
        guarded("b", run_b)
    res = {k: {m: _summ(v) for m, v in d.items()} for k, d in out.items() if d}
    counts = {k: hlo_counts(t) for k, t in texts.items()}
    return res, counts, mem, extra


def measure_fold(net: Net, x, reps: int) -> dict:
    """hlofold's own transformation time, separately from tracing: t(jax.make_jaxpr(f)) and
    t(hlofold.fold_jaxpr(closed_jaxpr)), each rep on a fresh function object."""
    trace, fold = [], []
    report = cj = None
    for _ in range(reps):
        f = net.f()
        t0 = _now(); cj = jax.make_jaxpr(f)(net.variables, x); t1 = _now()
        _, report = hlofold.fold_jaxpr(cj); t2 = _now()
        trace.append(t1 - t0)
        fold.append(t2 - t1)
    return {"trace_s": _summ(trace), "fold_jaxpr_s": _summ(fold), "fold_jaxpr_all_s": fold,
            "jaxpr_eqns": _count_eqns(cj.jaxpr), "report_counts": report.counts()}


def _count_eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for s in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(s, C.ClosedJaxpr):
                    n += _count_eqns(s.jaxpr)
                elif isinstance(s, C.Jaxpr):
                    n += _count_eqns(s)
    return n


def bench_batch(net: Net, batch, rounds, warmup, compile_reps, fold_reps, seed, log):
    x = jnp.asarray(np.random.default_rng(seed + batch).standard_normal(
        (batch, net.image_size, net.image_size, 3)).astype(np.float32))
    res: dict = {"model": net.key, "batch": batch, "image_size": net.image_size,
                 "loadavg_before": _loadavg(), "errors": {}}
    errors = res["errors"]
    tag = f"[{net.key} batch {batch}]"

    # 1) transformation + compile costs (AOT, fresh objects each rep)
    log(f"{tag} fold timing ...")
    try:
        res["fold"] = measure_fold(net, x, fold_reps)
    except Exception as e:  # noqa: BLE001
        errors["fold"] = _err(e)
    log(f"{tag} AOT compile timing ({compile_reps} reps) ...")
    res["compile"], res["hlo"], res["memory"], res["prepared"] = measure_compile(
        net, x, compile_reps, errors)

    # 2) first call (end-to-end: trace [+ fold + split] + compile + first run), fresh objects
    makers = make_variants(net)
    fns, first = {}, {}
    for name in VARIANTS:
        try:
            fn, p = makers[name]()
            dt, _ = _timed(fn, p, x)
        except Exception as e:  # noqa: BLE001
            errors.setdefault(name, _err(e))
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
            _timed(fns[name][0], fns[name][1], x)
    times = {n: [] for n in ok}
    log(f"{tag} {rounds} interleaved rounds ...")
    for r in range(rounds):
        k = r % max(1, len(ok))
        for name in ok[k:] + ok[:k]:
            dt, _ = _timed(fns[name][0], fns[name][1], x)
            times[name].append(dt)
    res["latency_s"] = {n: _summ(v) for n, v in times.items() if v}
    res["latency_all_s"] = times
    res["ratios"] = {}
    for num, den in RATIOS:
        if times.get(num) and times.get(den):
            rr = [t / u for t, u in zip(times[num], times[den])]
            res["ratios"][f"{num}/{den}"] = _summ(rr)
    res["first_call_s"] = first
    res["loadavg_after"] = _loadavg()
    res["first_call_overhead_s"] = {n: first[n] - res["latency_s"][n]["median"]
                                    for n in ok if n in res["latency_s"]}
    if "fold" in res and "a" in res["compile"]:
        ca = res["compile"]["a"]["compile_s"]["median"]
        fm = res["fold"]["fold_jaxpr_s"]["median"]
        res["fold_vs_compile_a"] = {"fold_jaxpr_median_s": fm, "compile_a_median_s": ca,
                                    "percent": 100.0 * fm / ca,
                                    "percent_of_lower_plus_compile": 100.0 * fm / (
                                        ca + res["compile"]["a"]["lower_s"]["median"])}
    res["process_memory"] = _rss_mb()
    res["device_memory"] = _device_memory()
    del fns
    return res


# --------------------------------------------------------------------------- markdown

def _ms(s):
    return f"{1e3 * s:.1f}" if s >= 0.01 else f"{1e3 * s:.2f}"


def _mb(b):
    return "–" if b is None else f"{b / 2 ** 20:.1f}"


def _ratio(b, key):
    r = b.get("ratios", {}).get(key)
    return f"{r['median']:.3f} [{r['min']:.2f}–{r['max']:.2f}]" if r else "–"


SUMMARY_PROGRAMS = ("a", "b_apply", "d")


def common_blocks(b, blocks) -> list[str]:
    """The residual blocks that no compared program ((a), (b) apply, (d)) has swallowed into a
    spanning fusion: per-block fusion counts are comparable on these."""
    h = b.get("hlo", {})
    gone = set()
    for p in SUMMARY_PROGRAMS:
        gone |= set(h.get(p, {}).get("spanned_blocks", ()))
    return [blk for blk in blocks if blk not in gone]


def _fpb(b, prog, blocks):
    """Mean ENTRY fusions per residual block of one program, over ``blocks``."""
    h = b.get("hlo", {}).get(prog)
    if not h or not blocks:
        return None
    return sum(h["fusions_per_block"].get(blk, 0) for blk in blocks) / len(blocks)


def summary_table(result: dict) -> list[str]:
    """The headline table: one row per model and batch."""
    gpu = result["machine"]["backend"] == "gpu"
    L = ["| model | batch | (a) unfolded ms | (b)/(a) | (b')/(a) | (c)/(a) | (b)/(d) | (c)/(d) "
         "| fold ms (% of XLA compile of (a)) | fusions per residual block (a) → (b) → (d) |"
         + (f" `{CUDNN_BIAS_ACT}` (a) → (b) → (d) |" if gpu else ""),
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
    for mk in result["models"]:
        for b in mk["batches"]:
            lat = b.get("latency_s", {})
            a = _ms(lat["a"]["median"]) if "a" in lat else "–"
            fv = b.get("fold_vs_compile_a")
            fold = (f"{1e3 * fv['fold_jaxpr_median_s']:.1f} ({fv['percent']:.1f}%)"
                    if fv else "–")
            blocks = common_blocks(b, mk.get("blocks") or [])
            fus = " → ".join("–" if _fpb(b, p, blocks) is None else f"{_fpb(b, p, blocks):.1f}"
                             for p in SUMMARY_PROGRAMS)
            nbl = len(mk.get("blocks") or [])
            if blocks and len(blocks) < nbl:
                fus += f" ({len(blocks)}/{nbl} blocks†)"
            L.append(f"| {mk['title']} | {b['batch']} | {a} | {_ratio(b, 'b/a')} | "
                     f"{_ratio(b, 'b' + chr(39) + '/a')} | {_ratio(b, 'c/a')} | "
                     f"{_ratio(b, 'b/d')} | {_ratio(b, 'c/d')} | {fold} | {fus} |"
                     + (" " + " → ".join(str(b.get("hlo", {}).get(p, {}).get(
                         "cudnn_conv_bias_activation", "–")) for p in ("a", "b_apply", "d"))
                        + " |" if gpu else ""))
    return L


def to_markdown(result: dict, png: str | None = None) -> str:
    m, cfg = result["machine"], result["config"]
    L = []
    names = ", ".join(mk["title"] for mk in result["models"])
    L.append(f"# BatchNorm folding benchmark: {names} ({m['backend'].upper()})\n")
    if cfg.get("quick"):
        L.append("**Quick (smoke) run: tiny networks and few rounds; the figures say nothing "
                 "about performance.**\n")
    if cfg.get("note"):
        L.append(f"**Note: {cfg['note']}**\n")
    L.append(f"Command: `{result['command']}`\n")
    L.append(f"- Machine: {m['cpu_model']} ({', '.join(m['cpu_isa']) or 'no AVX2/AVX-512 flags'}), "
             f"{m['sched_affinity_cpus']} usable cores (os.cpu_count={m['os_cpu_count']}), "
             f"{m['platform']}")
    L.append(f"- Device: {m['backend']} `{m['device_kind']}` ({', '.join(m['devices'])})")
    L.append(f"- Software: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
             f"flax {m['flax']}, numpy {m['numpy']}, hlofold {m['hlofold']}; "
             f"XLA_FLAGS=`{m['XLA_FLAGS'] or '(unset)'}`")
    L.append(f"- Date (UTC): {m['date_utc']}")
    c = result.get("code", {})
    dirty = [d for d, k in (("hlofold/", "hlofold_dirty"), ("benchmarks/", "benchmarks_dirty"))
             if c.get(k)]
    L.append(f"- Code: git {c.get('git_commit')}"
             + (f" with uncommitted changes in {' and '.join(dirty)}" if dirty else "")
             + f", hlofold sources sha256 {c.get('hlofold_sources_sha256')}")
    L.append(f"- Timing: {cfg['warmup']} warm-up calls per variant, then {cfg['rounds']} rounds; each "
             "round calls every variant once, in an order rotated by one each round; every call is "
             "wall-clock `time.perf_counter` around `jax.block_until_ready(f(params, x))` in one "
             "process. Ratios are computed per round (same round numerator/denominator) and "
             "summarised as median [min–max].")
    L.append(f"- Total runtime: {result['total_runtime_s']:.0f} s; process peak RSS "
             f"{result['process_memory']['peak_rss_mb']:.0f} MB.")
    L.append("")
    L.append("Variants:\n")
    for v in VARIANTS:
        L.append(f"- **({v})** {LABELS[v]}")
    L.append("")
    L.append("Networks (Flax linen, `benchmarks/models.py`; BN statistics drawn per channel: "
             "γ ~ 1+0.2·N, β ~ 0.1·N, μ ~ 0.2·N, σ² ~ exp(0.5·N); (d) is the same network built "
             "with `use_bn=False`, conv + bias, parameters `K·s`, `β−μ·s` computed in float64):\n")
    for mk in result["models"]:
        i = mk["info"]
        L.append(f"- {mk['title']}: {i['library']}, {i['num_bn']} BatchNorms, {i['num_blocks']} "
                 f"residual blocks, {i['num_params'] / 1e6:.2f} M parameters "
                 f"({i['param_mb']:.1f} MB), {i['dtype']}, NHWC {i['image_size']}×"
                 f"{i['image_size']}×3, {i['num_classes']} classes"
                 + (f", width {i['width']}" if "width" in i else "")
                 + (f", width multiplier {i['width_mult']}" if "width_mult" in i else ""))
    L.append("")
    L.append("## Summary\n")
    L.extend(summary_table(result))
    L.append("")
    L.append("Ratios: median [min–max] of per-round ratios; below 1 means faster than the "
             "denominator. Fold ms: `hlofold.fold_jaxpr` on the traced jaxpr (tracing excluded). "
             "Fusions per residual block: ENTRY-level fusions of the optimized HLO whose root's "
             "`op_name` lies in a residual block, averaged over the blocks; †: averaged only "
             "over the blocks that none of (a), (b), (d) swallowed into a fusion ending outside "
             "them (XLA:CPU's YNNPACK fuses the last blocks into one fusion ending at the "
             "head's mean; *spanning* fusions, see the batch sections).\n")
    if png:
        L.append(f"![latency relative to unfolded, compile times]({png})\n")
    errs: dict = {}
    for mk in result["models"]:
        if mk.get("error"):
            errs.setdefault((mk["title"], "build"), ([], mk["error"]))[0].append("-")
        for b in mk["batches"]:
            for k, v in b["errors"].items():
                errs.setdefault((mk["title"], k), ([], v))[0].append(str(b["batch"]))
    if errs:
        L.append("## Failures\n")
        for (t, k), (bts, v) in errs.items():
            L.append(f"- {t}, variant/step `{k}`, batch {', '.join(bts)} (first error):"
                     f"\n\n```\n{v.strip()}\n```")
        L.append("")
    for mk in result["models"]:
        for b in mk["batches"]:
            L.extend(_batch_section(mk, b, cfg, m))
    L.append("## Method\n")
    L.append("Counting method (optimized HLO, `jax.jit(...).lower(...).compile().as_text()`): "
             "every instruction line `%name = <shape> <opcode>(…)` is parsed; *fusions* counts "
             "opcode `fusion` anywhere in the module; *entry ops* counts ENTRY instructions except "
             "parameter/constant/bitcast/get-tuple-element/tuple (≈ kernels launched); "
             "*convolutions* counts opcode `convolution` anywhere, including inside fused "
             "computations; *per block*: an ENTRY fusion belongs to the block named in its "
             "`op_name` metadata (that of the fusion's root; `/stage<s>_block<i>/`, "
             "`/block<i>/`), counted once; *multi-block* fusions hold ops of several blocks in "
             "their fused computation (e.g. a block's residual add fused into the next block's "
             "conv); *spanning* fusions end outside any block but take in blocks (XLA:CPU's "
             "YNNPACK can fuse whole stages into one fusion ending at the head's mean), so "
             "those blocks show few or no fusions of their own; fusions outside any block "
             "(stem, head, kernel re-layouts without metadata) are not in the per-block "
             "figures. "
             "On GPU, *cuDNN* counts `custom-call`s with a `__cudnn$conv…` target and, separately, "
             f"`{CUDNN_BIAS_ACT}` (conv fused with bias and activation).\n")
    L.append("Compile-time method: (a),(d): `jax.jit(f).lower(params, x)` then `.compile()`, timed "
             "separately. (c): `Folded.lower(params, x)` (trace + fold + lower) then `.compile()`. "
             "(b): `Folded.split(params, x)` (trace + fold + prepare/apply split) then lower and "
             "compile of the apply and prepare jaxprs, which are the two executables (b) runs. "
             "Each rep uses fresh Python function objects so no JAX trace/compile cache is hit. "
             "Fold time: `hlofold.fold_jaxpr(jax.make_jaxpr(f)(params, x))`, tracing timed "
             "separately and excluded.\n")
    L.append("Memory method: per program, XLA's `compiled.memory_analysis()` (buffer assignment "
             "of the compiled executable): arguments, outputs, temporaries, and "
             "`peak_memory_in_bytes` where the backend reports it (0 or absent on CPU). Frozen "
             "constants of (c) are part of the executable, not of its arguments. (b) keeps the "
             "prepared (folded) parameters cached next to the original ones: *prepared MB*. "
             "Process memory: RSS from `/proc/self/statm` after each batch and the process peak "
             "(`getrusage` `ru_maxrss`), which covers every variant of every model measured so "
             "far in the one process, so it is an upper bound, not a per-variant figure.\n")
    return "\n".join(L)


def _batch_section(mk: dict, b: dict, cfg: dict, m: dict) -> list[str]:
    L = [f"## {mk['title']}, batch {b['batch']}\n"]
    lat = b.get("latency_s", {})
    L.append("| variant | median ms | min–max ms | first call s | max abs diff vs (a) |")
    L.append("|---|---:|---:|---:|---:|")
    for v in VARIANTS:
        if v not in lat:
            L.append(f"| ({v}) {LABELS[v]} | failed | | | |")
            continue
        s = lat[v]
        L.append(f"| ({v}) {LABELS[v]} | {_ms(s['median'])} | {_ms(s['min'])}–{_ms(s['max'])} | "
                 f"{b['first_call_s'][v]:.2f} | {b['max_abs_diff_vs_a'].get(v, float('nan')):.1e} |")
    if b.get("max_abs_logit_a"):
        L.append(f"\n(max |logit| of (a): {b['max_abs_logit_a']:.3g}, so the largest relative "
                 f"difference is {max(b['max_abs_diff_vs_a'].values()) / b['max_abs_logit_a']:.1e}; "
                 f"1-min load average before/after: {b['loadavg_before']} / {b['loadavg_after']})\n")
    L.append("| per-round ratio | median | min–max |")
    L.append("|---|---:|---:|")
    for k, s in b["ratios"].items():
        n, d = k.split("/")
        L.append(f"| ({n})/({d}) | {s['median']:.3f} | {s['min']:.3f}–{s['max']:.3f} |")
    c = b.get("compile", {})
    L.append(f"\nCompile / transform cost (median of {cfg['compile_reps']} AOT reps, fresh "
             "function objects each rep):\n")
    L.append("| program | trace+lower s | XLA compile s |")
    L.append("|---|---:|---:|")
    if "a" in c:
        L.append(f"| (a) unfolded | {c['a']['lower_s']['median']:.3f} | {c['a']['compile_s']['median']:.3f} |")
    if "d" in c:
        L.append(f"| (d) ideal | {c['d']['lower_s']['median']:.3f} | {c['d']['compile_s']['median']:.3f} |")
    if "c" in c:
        L.append(f"| (c) frozen (`Folded.lower` incl. trace+fold; then `.compile()`) | "
                 f"{c['c']['lower_s']['median']:.3f} | {c['c']['compile_s']['median']:.3f} |")
    if "b" in c and "apply_compile_s" in c["b"]:
        L.append(f"| (b) `Folded.split` (trace+fold+host prepare), apply program | "
                 f"{c['b']['split_s']['median']:.3f} + {c['b']['apply_lower_s']['median']:.3f} | "
                 f"{c['b']['apply_compile_s']['median']:.3f} |")
        if "prepare_compile_s" in c["b"]:
            L.append(f"| (b) prepare program | {c['b']['prepare_lower_s']['median']:.3f} | "
                     f"{c['b']['prepare_compile_s']['median']:.3f} |")
    f, fv = b.get("fold"), b.get("fold_vs_compile_a")
    if f:
        L.append(f"\nhlofold transform alone: `hlofold.fold_jaxpr(jax.make_jaxpr(f)(params, x))` "
                 f"= **{1e3 * f['fold_jaxpr_s']['median']:.1f} ms** median "
                 f"({1e3 * f['fold_jaxpr_s']['min']:.1f}–{1e3 * f['fold_jaxpr_s']['max']:.1f} ms, "
                 f"{f['fold_jaxpr_s']['n']} reps; jaxpr of {f['jaxpr_eqns']} equations incl. nested; "
                 f"tracing itself {1e3 * f['trace_s']['median']:.1f} ms, not included)"
                 + (f". Relative to XLA compile of (a) ({fv['compile_a_median_s']:.3f} s): "
                    f"**{fv['percent']:.1f}%** (of lower+compile: "
                    f"{fv['percent_of_lower_plus_compile']:.1f}%)" if fv else "")
                 + f". Fold report: {f['report_counts']}.\n")
    if b.get("first_call_overhead_s"):
        L.append("First-call overhead (first call − steady-state median; includes trace, "
                 "hlofold fold/split where applicable, XLA compile(s), prepare run, first run): "
                 + ", ".join(f"({v}) {s:.2f} s" for v, s in b["first_call_overhead_s"].items())
                 + "\n")
    h, mem = b.get("hlo", {}), b.get("memory", {})
    gpu = m["backend"] == "gpu"
    L.append("Optimized HLO and memory (`compiled.memory_analysis()`, MB):\n")
    head = ("| program | fusions (by kind) | entry ops | convolutions | entry constants "
            "| fusions in blocks (mean per block) | multi-block / spanning (blocks) | args MB "
            "| temp MB | output MB |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if gpu:
        head += " cuDNN convs | of which conv+bias+act |"
        sep += "---:|---:|"
    L.append(head)
    L.append(sep)
    nb = mk["info"]["num_blocks"] or 1
    for key, name in PROGRAMS:
        if key not in h:
            continue
        hh, mm = h[key], mem.get(key) or {}
        kinds = ", ".join(f"{k}:{v}" for k, v in hh["fusion_kinds"].items())
        row = (f"| {name} | {hh['fusions']} ({kinds}) | {hh['entry_ops']} | "
               f"{hh['convolutions']} | {hh['constants_in_entry']} | "
               f"{hh['fusions_in_blocks']} ({hh['fusions_in_blocks'] / nb:.2f}) | "
               f"{hh.get('multi_block_fusions', 0)} / {hh.get('spanning_fusions', 0)} "
               f"({hh.get('blocks_in_spanning_fusions', 0)}) | "
               f"{_mb(mm.get('argument_size'))} | {_mb(mm.get('temp_size'))} | "
               f"{_mb(mm.get('output_size'))} |")
        if gpu:
            row += f" {hh['cudnn_convs']} | {hh['cudnn_conv_bias_activation']} |"
        L.append(row)
    pr = b.get("prepared", {})
    if pr.get("prepared_mb") is not None:
        L.append(f"\n(b) caches {pr['prepared_mb']:.1f} MB of prepared (folded) parameters, "
                 f"computed from {pr['prepared_from']} parameter arrays, next to the "
                 f"{mk['info']['param_mb']:.1f} MB of original parameters.")
    pm = b.get("process_memory", {})
    L.append(f"Process RSS after this batch {pm.get('rss_mb') or 0:.0f} MB, peak so far "
             f"{pm.get('peak_rss_mb') or 0:.0f} MB"
             + (f"; device memory {b['device_memory']}" if b.get("device_memory") else "") + ".\n")
    blocks = mk.get("blocks") or []
    if blocks and any(h.get(k, {}).get("fusions_per_block") for k in ("a", "b_apply", "d")):
        L.append("<details><summary>Fusions per residual block (ENTRY fusions by their "
                 "root's op_name): (a) / (b) apply / (c) / (d)</summary>\n")
        L.append("| block | (a) | (b) apply | (c) | (d) |")
        L.append("|---|---:|---:|---:|---:|")
        for blk in blocks:
            vals = [(str(h[k]["fusions_per_block"].get(blk, 0))
                     + ("*" if blk in h[k].get("spanned_blocks", ()) else "")) if k in h else "–"
                    for k in ("a", "b_apply", "c", "d")]
            L.append(f"| {blk} | " + " | ".join(vals) + " |")
        L.append("\n\\*: (part of) the block is inside a fusion that ends outside it "
                 "(spanning).\n\n</details>\n")
    return L


def assess(result: dict) -> list[str]:
    lines = []
    for mk in result["models"]:
        for b in mk["batches"]:
            for v in ("b", "c"):
                r = b["ratios"].get(f"{v}/a")
                if not r:
                    lines.append(f"- {mk['title']} batch {b['batch']}: ({v}) not measured.")
                    continue
                la, lv = b["latency_s"]["a"]["median"], b["latency_s"][v]["median"]
                ok_lat, ok_ratio = lv <= la, r["median"] <= 1.0
                verdict = ("meets target ≤ (a) on both." if ok_lat and ok_ratio else
                           "**falls short of target ≤ (a) on both.**" if not (ok_lat or ok_ratio)
                           else "**mixed**: " + ("median latency meets, " if ok_lat else
                                                 "median latency falls short, ")
                           + ("per-round ratio meets." if ok_ratio else
                              "per-round ratio falls short."))
                lines.append(f"- {mk['title']} batch {b['batch']}: ({v}) median "
                             f"{1e3 * lv:.2f} ms vs (a) {1e3 * la:.2f} ms; per-round ({v})/(a) "
                             f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]: " + verdict)
            fv = b.get("fold_vs_compile_a")
            if fv:
                lines.append(f"- {mk['title']} batch {b['batch']}: fold time "
                             f"{1e3 * fv['fold_jaxpr_median_s']:.1f} ms = {fv['percent']:.1f}% of "
                             f"(a) XLA compile {fv['compile_a_median_s']:.3f} s: "
                             + ("meets target < 5%." if fv["percent"] < 5 else
                                "**falls short of target < 5%.**"))
    return lines


# --------------------------------------------------------------------------- chart

def plot(result: dict, path: str) -> None:
    """Bar chart: per model and batch, latency of (b), (b'), (c), (d) relative to (a)
    (median per-round ratio, min–max whiskers), and compile vs fold times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(mk, b) for mk in result["models"] for b in mk["batches"]]
    labels = [f"{mk['title']}\nbatch {b['batch']}" for mk, b in groups]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7.0, 1.9 * len(groups) + 2), 8.5))
    xs = np.arange(len(groups))
    series = [("b/a", "(b) folded, cached prepare"), ("b'/a", "(b') folded, no cache"),
              ("c/a", "(c) frozen"), ("d/a", "(d) ideal, no BN")]
    w = 0.8 / len(series)
    for i, (key, lab) in enumerate(series):
        med, lo, hi = [], [], []
        for _, b in groups:
            r = b.get("ratios", {}).get(key)
            med.append(r["median"] if r else np.nan)
            lo.append(r["median"] - r["min"] if r else 0)
            hi.append(r["max"] - r["median"] if r else 0)
        pos = xs + (i - (len(series) - 1) / 2) * w
        ax1.bar(pos, med, w, yerr=[lo, hi], capsize=2, label=lab)
        for px, v in zip(pos, med):
            if np.isnan(v):
                ax1.text(px, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
    ax1.axhline(1.0, color="k", lw=0.8, ls="--")
    ax1.set_xticks(xs, labels, fontsize=8)
    ax1.set_ylabel("latency / unfolded (a)\nmedian per-round ratio, min–max")
    ax1.legend(fontsize=8, ncol=2)
    ax1.set_title("Steady-state latency relative to unfolded jax.jit(model.apply)", fontsize=10)

    def med(b, key, field="compile_s"):
        c = b.get("compile", {}).get(key, {}).get(field)
        return c["median"] if c else np.nan

    cseries = ["a", "b", "c", "d", "fold"]
    w = 0.8 / len(cseries)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, key in enumerate(cseries):
        pos = xs + (i - (len(cseries) - 1) / 2) * w
        if key == "fold":
            vals = [b["fold"]["fold_jaxpr_s"]["median"] if b.get("fold") else np.nan
                    for _, b in groups]
            ax2.bar(pos, vals, w, color=colors[4], hatch="//", label="hlofold fold_jaxpr")
        elif key == "b":
            app = [med(b, "b", "apply_compile_s") for _, b in groups]
            ax2.bar(pos, app, w, color=colors[1], label="(b) XLA compile, apply program")
        else:
            lab = {"a": "(a) XLA compile", "c": "(c) XLA compile, frozen",
                   "d": "(d) XLA compile"}[key]
            ax2.bar(pos, [med(b, key) for _, b in groups], w, color=colors[i], label=lab)
    ax2.set_xticks(xs, labels, fontsize=8)
    ax2.set_ylabel("seconds (median of AOT reps)")
    ax2.legend(fontsize=8, ncol=2)
    ax2.set_title("Compile time vs hlofold fold time", fontsize=10)
    m = result["machine"]
    fig.suptitle("hlofold BatchNorm folding" + (" (QUICK smoke run)" if result["config"].get(
        "quick") else ""), fontsize=12)
    fig.text(0.01, 0.005, machine_line(m) + f"; {m['date_utc']}", fontsize=7, ha="left",
             va="bottom")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def write_outputs(result: dict, out: str, stem: str, plot_png: bool = True) -> str | None:
    os.makedirs(out, exist_ok=True)
    png = None
    if plot_png:
        try:
            plot(result, os.path.join(out, stem + ".png"))
            png = stem + ".png"
        except Exception as e:  # noqa: BLE001 -- the tables matter more than the chart
            print(f"chart FAILED: {_err(e)}", file=sys.stderr)
            result["plot_error"] = _err(e)
    md = to_markdown(result, png)
    md += "\n## Targets\n\n" + "\n".join(result["assessment"]) + "\n"
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)
    return png


def render(path: str, out: str, name: str | None) -> int:
    with open(path) as f:
        result = json.load(f)
    result["assessment"] = assess(result)
    stem = name or os.path.splitext(os.path.basename(path))[0]
    write_outputs(result, out, stem)
    print("\n".join(summary_table(result)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out, args.name)
    if args.quick and not os.environ.get("XLA_FLAGS"):
        os.environ["XLA_FLAGS"] = QUICK_XLA_FLAGS   # read when the backend starts (below)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = _now()
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
            entry.update(error=_err(e), info={}, blocks=[])
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
              "command": cmdline, "total_runtime_s": _now() - t_start,
              "process_memory": _rss_mb(), "device_memory": _device_memory()}
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
