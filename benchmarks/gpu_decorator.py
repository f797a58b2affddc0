"""The decorator on a GPU, next to ``jax.jit``: ``python -m benchmarks.gpu decorator``.

For ResNet-50 (Flax), RepVGG-A0 and MobileOne-S0 (Flax, 224 px) and the 0.54 B decoder, at
batch 1, 8 and 32 (the decoder: 1, 8 sequences of 128 tokens): ``hlofold.fold(apply)`` and
``jax.jit(apply)`` — first call (trace, fold, compile, run; the fold first, so it pays any
process-wide warm-up) and steady calls in interleaved rounds (medians, min–max) — and the
outputs of both compared with ``jax.jit(apply)`` on the machine's CPU (max |Δ| over the
largest |output|). The lent machine runs jax 0.11.2: this is the decorator path there.
``--quick``: small sizes and batch 1, to try the script on a CPU.
"""
from __future__ import annotations

import json
import os
import traceback

import numpy as np

from .common import now, steady


def _on_cpu(fn, *args):
    import jax
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = jax.device_put(args, cpu)
        return np.asarray(jax.jit(fn)(*args), np.float64)


def _row(name, apply, v, x, rounds, calls) -> dict:
    import jax
    import hlofold
    folded = hlofold.fold(apply)
    plain = jax.jit(apply)
    t0 = now()
    got = np.asarray(jax.block_until_ready(folded(v, x)), np.float64)
    first_fold = now() - t0
    t0 = now()
    ref = np.asarray(jax.block_until_ready(plain(v, x)), np.float64)
    first_jit = now() - t0
    cpu = _on_cpu(apply, v, x)
    scale = float(np.max(np.abs(cpu))) or 1.0
    rep = folded.report(v, x)
    res = {"model": name, "batch": int(x.shape[0]), "backend": jax.default_backend(),
           "first_call_s": {"jit": first_jit, "fold": first_fold},
           "folded": rep.num_folded, "merged": len(rep.merged), "running": rep.running,
           "rel_diff_vs_cpu": {"jit": float(np.max(np.abs(ref - cpu))) / scale,
                               "fold": float(np.max(np.abs(got - cpu))) / scale},
           "rel_diff_fold_vs_jit": float(np.max(np.abs(got - ref))) / scale}
    res["steady_ms"] = steady({"jit": plain, "fold": folded}, {"jit": (v, x), "fold": (v, x)},
                              rounds, calls)
    return res


def decorator_part(quick: bool) -> dict:
    import jax.numpy as jnp
    from hlofold.examples import decoder_apply, init_decoder
    from .gpu import gpu_models
    models, image = gpu_models(quick)
    batches = (1,) if quick else (1, 8, 32)    # --quick: one batch (a smoke run; compiles cost)
    rounds, calls = (3, 2) if quick else (int(os.environ.get("HLOFOLD_GPU_ROUNDS", 9)), 10)
    kw = dict(layers=2, d=128, vocab=512) if quick else dict(layers=8, d=2048, ffn=5632,
                                                            vocab=32000)
    params = init_decoder(**kw)
    cases = [(name, apply, v, lambda b, s=size: image(b, s)) for name, apply, v, size in models]
    cases.append(("decoder_0.54B" if not quick else "decoder_small", decoder_apply, params,
                  lambda b: jnp.asarray(np.random.default_rng(2).integers(
                      0, kw["vocab"], (b, 16 if quick else 128)), jnp.int32)))
    rows = []
    for name, apply, v, make_x in cases:
        for b in batches if not name.startswith("decoder") else batches[:2]:
            try:
                rows.append(_row(name, apply, v, make_x(b), rounds, calls))
            except Exception as e:                  # noqa: BLE001
                rows.append({"model": name, "batch": b,
                             "error": f"{type(e).__name__}: {e}"[:600],
                             "trace": traceback.format_exc()[-1500:]})
            print(json.dumps(rows[-1])[:400], flush=True)
            if os.environ.get("OUT"):           # each row as it comes (a part may be cut)
                with open(os.path.join(os.environ["OUT"], "decorator_rows.json"), "w") as fh:
                    json.dump(rows, fh, default=str)
    return {"decorator": rows}
