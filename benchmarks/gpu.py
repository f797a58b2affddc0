"""hlofold on a GPU machine, next to doing nothing: one prepared run for a lent accelerator.

The project's GPU machines (when a session is lent one) carry their own JAX, which may be
newer than the window hlofold is tested with (``hlofold._compat.TESTED``); nothing can be
installed there. So this script records what the machine has and checks three things:

* ``env``: versions, devices, which hlofold features ``_compat`` switched off there;
* ``entry``: every entry point on a small Flax ResNet, on the GPU — ``fold(f)`` and its
  steady path, ``freeze=``, under ``jax.jit``, ``fold_jaxpr``, ``fold_params``, ``lower``,
  ``export``, ``fold_stablehlo`` of an export (in the graph and with ``params=``) — each
  compared with ``jax.jit(f)`` (max |Δ|), with what the report says about running;
* ``hlo``: the StableHLO path as a GPU user runs it: ``jax.export`` of the train-time model
  (weights as arguments), ``fold_stablehlo(params=)``, the folded module next to the module
  as given, steady calls in interleaved rounds (medians, min–max), first calls, the fold's
  time, max |Δ|, and ``hlofold.verify`` of the two on every backend present (GPU and CPU).
  Models: ResNet-50 and the Flax RepVGG-A0 / MobileOne-S0 (224 px) and the 0.54 B decoder;
* ``decorator``: ``hlofold.fold`` next to ``jax.jit`` on those models and the decoder, first and
  steady calls at batch 1/8/32, outputs against the machine's CPU (``benchmarks.gpu_decorator``);
* ``stack``: the same for scanned layer stacks (a ``lax.scan`` over stacked weights, folded
  once per layer by ``fold_stablehlo(params=)``): a conv → BN stack and the 0.54 B decoder
  as one scan (the MaxText layout).

``python -m benchmarks.gpu PART --out DIR`` writes ``DIR/PART.json``; ``--quick`` uses small
sizes (to try the script on a CPU). ``docs/benchmarks/gpu.md`` records a run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np

from hlofold._ir.stablehlo.artifacts import module_callable

from .common import now, steady
from .gpu_decorator import decorator_part


def maxdiff(a, b) -> float:
    import jax
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(la, lb))


def env_part(quick: bool) -> dict:
    import jax
    import hlofold
    from hlofold import _compat as C
    out = {"python": sys.version.split()[0], "jax": jax.__version__,
           "devices": [str(d) for d in jax.devices()],
           "device_kind": getattr(jax.devices()[0], "device_kind", "?"),
           "tested": list(C.TESTED), "untested": bool(C.untested()),
           "changed": {k: str(v) for k, v in dict(C.CHANGED).items()},
           "disabled": {f: str(C.disabled(f)) for f in
                        ("jaxpr", "source", "shard_map", "stablehlo", "export")
                        if C.disabled(f) is not None},
           "hlofold": hlofold.__version__}
    for mod in ("jaxlib", "flax", "numpy", "equinox", "optax"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:                       # noqa: BLE001
            out[mod] = f"absent ({type(e).__name__})"
    return out


def _resnet(quick: bool, batch: int = 2, size: int = 32):
    from benchmarks.models import build
    import jax.numpy as jnp
    model, _, v, _ = build("resnet18", image_size=size, num_classes=10,
                           width=8 if quick else 16)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, size, size, 3)),
                    jnp.float32)
    return lambda v, x: model.apply(v, x), v, x


def entry_part(quick: bool) -> dict:
    import jax
    import hlofold
    f, v, x = _resnet(quick)
    ref = jax.jit(f)(v, x)
    rows = {}

    def check(name, fn):
        t0 = now()
        try:
            got, note = fn()
            rows[name] = {"ok": True, "max_abs_diff": maxdiff(ref, got), "note": note,
                          "s": now() - t0}
        except Exception as e:                       # noqa: BLE001
            rows[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                          "trace": traceback.format_exc()[-1500:], "s": now() - t0}

    def decorator():
        g = hlofold.fold(f)
        g(v, x)
        out = g(v, x)
        r = g.report(v, x) if hasattr(g, "report") else None
        return out, {"folded": getattr(r, "num_folded", None),
                     "running": getattr(r, "running", None)}
    check("fold(f), steady", decorator)

    def freeze():
        g = hlofold.fold(f, freeze=0)
        return g(v, x), None
    check("fold(f, freeze=0)", freeze)
    check("jit(fold(f))", lambda: (jax.jit(lambda v, x: hlofold.fold(f)(v, x))(v, x), None))

    def fj():
        closed = jax.make_jaxpr(f)(v, x)
        new, rep = hlofold.fold_jaxpr(closed)
        from hlofold._compat import jaxpr_as_fun
        out = jaxpr_as_fun(new)(*jax.tree_util.tree_leaves((v, x)))
        return out, {"folded": rep.num_folded, "running": getattr(rep, "running", None)}
    check("fold_jaxpr", fj)

    def fp():
        res = hlofold.fold_params(f, v, x)
        return jax.jit(f)(res.params, x), {"changes": len(getattr(res, "changes", []) or [])}
    check("fold_params", fp)

    def low():
        text = hlofold.lower(f, v, x)
        return ref, {"chars": len(str(text)), "convs": str(text).count("stablehlo.convolution")}
    check("lower", low)

    def exp():
        e = hlofold.export(f, v, x)
        return e.call(v, x), None
    check("export", exp)

    exported = jax.export.export(jax.jit(f))(v, x)

    def shlo_graph():
        new, rep = hlofold.fold_stablehlo(exported, in_graph=True)
        return new.call(v, x), {"folded": rep.num_folded, "running": rep.running}
    check("fold_stablehlo(Exported, in_graph=True)", shlo_graph)

    def shlo_params():
        leaves = jax.tree_util.tree_leaves(v)
        params = {i: np.asarray(a) for i, a in enumerate(leaves)}
        new, rep, prepared = hlofold.fold_stablehlo(exported, params=params)
        out = module_callable(new)(x, *prepared)
        return out, {"folded": rep.num_folded, "merged": len(getattr(rep, "merged", [])),
                     "convs": new.mlir_module().count("stablehlo.convolution")}
    check("fold_stablehlo(Exported, params=)", shlo_params)
    return {"entry": rows}


def gpu_models(quick: bool):
    """(name, apply(v, x), variables, x-maker by batch)."""
    import jax.numpy as jnp
    from benchmarks import repmodels as R
    from benchmarks.models import build
    size = 64 if quick else 224
    out = []
    model, _, v, _ = build("resnet50", image_size=size, width=16 if quick else None)
    out.append(("resnet50", lambda v, x: model.apply(v, x), v, size))
    for arch in ("repvgg_a0", "mobileone_s0"):
        apply, v, _ = R.make(arch, size=size, batch=1)
        out.append((arch, apply, v, size))

    def image(batch, size):
        return jnp.asarray(np.random.default_rng(1).standard_normal((batch, size, size, 3)),
                           jnp.float32)
    return out, image


def _hlo_case(name, apply, v, x, rounds, calls) -> dict:
    """One model through jax.export → fold_stablehlo(params=) → run, next to the export."""
    import jax
    import hlofold
    leaves, tree = jax.tree_util.tree_flatten(v)
    t0 = now()
    exported = jax.export.export(jax.jit(apply))(v, x)
    export_s = now() - t0
    t0 = now()
    new, rep, prepared = hlofold.fold_stablehlo(
        exported, params={i: np.asarray(a) for i, a in enumerate(leaves)})
    fold_s = now() - t0
    orig_args = [*leaves, x]
    new_args = [x, *prepared]
    t0 = now()
    run_o, run_n = module_callable(exported), module_callable(new)     # flat inputs
    ref = jax.block_until_ready(run_o(*orig_args))
    first_orig = now() - t0
    t0 = now()
    got = jax.block_until_ready(run_n(*new_args))
    first_new = now() - t0
    res = {"model": name, "batch": int(x.shape[0]), "export_s": export_s,
           "fold_stablehlo_s": fold_s, "first_call_s": {"original": first_orig,
                                                         "folded": first_new},
           "folded": rep.num_folded, "merged": len(getattr(rep, "merged", [])),
           "refused": len(getattr(rep, "refused", [])),
           "convs": {"original": exported.mlir_module().count("stablehlo.convolution"),
                     "folded": new.mlir_module().count("stablehlo.convolution")},
           "dots": {"original": exported.mlir_module().count("stablehlo.dot_general"),
                    "folded": new.mlir_module().count("stablehlo.dot_general")},
           "max_abs_diff": maxdiff(ref, got),
           "max_abs_ref": float(np.max(np.abs(np.asarray(ref, np.float64))))}
    # ``Exported.call`` un-jitted pays Python dispatch per argument (~17 µs each on the
    # project's CPU VM: the original passes every weight, the folded module its prepared
    # ones), so both are timed as called and under ``jax.jit`` (the compute)
    res["steady_ms"] = steady({"original": run_o, "folded": run_n,
                               "jit original": jax.jit(run_o), "jit folded": jax.jit(run_n)},
                              {"original": orig_args, "folded": new_args,
                               "jit original": orig_args, "jit folded": new_args},
                              rounds, calls)
    res["arguments"] = {"original": len(orig_args), "folded": len(new_args)}
    return res


def hlo_part(quick: bool) -> dict:
    models, image = gpu_models(quick)
    batches = (1, 8) if quick else tuple(int(b) for b in os.environ.get(
        "HLOFOLD_GPU_BATCHES", "1,8,32").split(","))
    rounds, calls = (3, 3) if quick else (int(os.environ.get("HLOFOLD_GPU_ROUNDS", 11)), 10)
    rows = []
    for name, apply, v, size in models:
        for b in batches:
            try:
                rows.append(_hlo_case(name, apply, v, image(b, size), rounds, calls))
            except Exception as e:                  # noqa: BLE001
                rows.append({"model": name, "batch": b,
                             "error": f"{type(e).__name__}: {e}"[:600],
                             "trace": traceback.format_exc()[-1500:]})
            print(json.dumps(rows[-1])[:400], flush=True)
            if os.environ.get("OUT"):           # each row as it comes (a part may be cut)
                with open(os.path.join(os.environ["OUT"], "hlo_rows.json"), "w") as fh:
                    json.dump(rows, fh, default=str)
    return {"hlo": rows}


def decoder_part(quick: bool) -> dict:
    import jax.numpy as jnp
    from hlofold.examples import decoder_apply, init_decoder
    kw = dict(layers=2, d=128, vocab=512) if quick else dict(layers=8, d=2048, ffn=5632,
                                                            vocab=32000)
    params = init_decoder(**kw)
    rows = []
    for b, t in ((1, 16), (8, 512)) if not quick else ((1, 16),):
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, kw["vocab"], (b, t)),
                             jnp.int32)
        try:
            rows.append(_hlo_case(f"decoder d={kw['d']} L={kw['layers']}", decoder_apply,
                                  params, tokens, 3 if quick else 9, 3 if quick else 10))
        except Exception as e:                      # noqa: BLE001
            rows.append({"model": "decoder", "batch": b, "tokens": t,
                         "error": f"{type(e).__name__}: {e}"[:600],
                         "trace": traceback.format_exc()[-1500:]})
        rows[-1]["tokens"] = t
        print(json.dumps(rows[-1])[:400], flush=True)
    return {"decoder": rows}


def _scanned_cnn(layers: int, c: int):
    """A stack of ``layers`` conv 3×3 → BatchNorm → relu blocks as one ``lax.scan`` over
    stacked parameters (the ``nn.scan`` layout), then a global pool."""
    import jax
    from jax import lax
    rng = np.random.default_rng(2)
    p = {"k": (rng.standard_normal((layers, 3, 3, c, c)) * (2 / (9 * c)) ** 0.5
               ).astype(np.float32),
         "mean": (rng.standard_normal((layers, c)) * 0.1).astype(np.float32),
         "var": rng.uniform(0.5, 2, (layers, c)).astype(np.float32),
         "gamma": rng.uniform(0.5, 1.5, (layers, c)).astype(np.float32),
         "beta": (rng.standard_normal((layers, c)) * 0.1).astype(np.float32)}

    def apply(p, x):
        def body(h, q):
            y = lax.conv_general_dilated(h, q["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu((y - q["mean"]) * lax.rsqrt(q["var"] + 1e-5) * q["gamma"]
                               + q["beta"]), None
        return lax.scan(body, x, p)[0].mean((1, 2))
    return apply, p


def stack_part(quick: bool) -> dict:
    """Scanned layer stacks through the StableHLO path (issue 39): ``jax.export`` of a
    ``lax.scan`` over stacked weights (weights as arguments), ``fold_stablehlo(params=)``
    folding the loop's body once per layer — a conv → BN stack and the 0.54 B decoder as
    one scan (``examples.scanned_decoder_apply``, the MaxText layout)."""
    import jax.numpy as jnp
    from hlofold.examples import init_decoder, scanned_decoder_apply, stack_decoder
    rounds, calls = (3, 3) if quick else (9, 10)
    rows = []

    def row(name, apply, v, x, **extra):
        try:
            rows.append(_hlo_case(name, apply, v, x, rounds, calls))
        except Exception as e:                      # noqa: BLE001
            rows.append({"model": name, "batch": int(x.shape[0]),
                         "error": f"{type(e).__name__}: {e}"[:600],
                         "trace": traceback.format_exc()[-1500:]})
        rows[-1].update(extra)
        print(json.dumps(rows[-1])[:400], flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "stack_rows.json"), "w") as fh:
                json.dump(rows, fh, default=str)
    L, c, size = (3, 8, 8) if quick else (16, 64, 56)
    apply, v = _scanned_cnn(L, c)
    for b in (1, 8):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((b, size, size, c)),
                        jnp.float32)
        row(f"conv-BN stack L={L} c={c} {size} px", apply, v, x)
    kw = dict(layers=2, d=128, vocab=512) if quick else dict(layers=8, d=2048, ffn=5632,
                                                            vocab=32000)
    params = stack_decoder(init_decoder(**kw))
    for b, t in ((1, 16), (8, 512)) if not quick else ((1, 16),):
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, kw["vocab"], (b, t)),
                             jnp.int32)
        row(f"scanned decoder d={kw['d']} L={kw['layers']}", scanned_decoder_apply, params,
            tokens, tokens=t)
    return {"stack": rows}


def verify_part(quick: bool) -> dict:
    """hlofold.verify of an exported ResNet and its fold on every backend present (the
    GPU computes float32 convolutions in TF32 by default on Hopper: does the tolerance
    model hold there?)."""
    import jax
    import hlofold
    f, v, x = _resnet(quick, batch=4, size=64)
    leaves = jax.tree_util.tree_leaves(v)
    exported = jax.export.export(jax.jit(f), platforms=["cpu", "cuda"])(v, x) if any(
        d.platform == "gpu" for d in jax.devices()) else jax.export.export(jax.jit(f))(v, x)
    new, rep = hlofold.fold_stablehlo(exported, in_graph=True)
    out = {}
    for name, (a, b) in {"fold_stablehlo in graph": (exported, new)}.items():
        try:
            r = hlofold.verify(a, b, *leaves, x, raise_on_failure=False)
            out[name] = {"passed": bool(r.passed), "report": str(r)[:3000],
                         "folded": rep.num_folded}
        except Exception as e:                      # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:600],
                         "trace": traceback.format_exc()[-1500:]}
    try:
        g = hlofold.fold(f, verify=True)
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = g(v, x)
        out["fold(f, verify=True)"] = {"warnings": [str(m.message)[:400] for m in w],
                                       "max_abs_diff": maxdiff(jax.jit(f)(v, x), got)}
    except Exception as e:                          # noqa: BLE001
        out["fold(f, verify=True)"] = {"error": f"{type(e).__name__}: {e}"[:600]}
    return {"verify": out}


PARTS = {"env": env_part, "entry": entry_part, "verify": verify_part, "hlo": hlo_part,
         "decoder": decoder_part, "stack": stack_part, "decorator": decorator_part}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    t0 = now()
    try:
        res = PARTS[a.part](a.quick)
    except Exception as e:                          # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}"[:800], "trace": traceback.format_exc()}
    res["part_s"] = now() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.part}.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"{a.part}: {res['part_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
