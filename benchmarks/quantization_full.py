"""Cross-layer equalization at the sizes users run (issue 51): ResNet-50 and a width-1.0
MobileNetV2-style net at 224 px, batch 2, every BN's γ (ResNet-50) or the depthwise BNs' γ
(MobileNetV2) spread over two decades as in ``benchmarks/quantization.py --equalize``.

Per seed: per-tensor int8 error of the folded weights, of the folded + equalized ones, and
per-channel int8 of the folded weights (the plain quantizer of
``benchmarks.quantization.quantize``), with the time ``fold_params(..., equalize=True)``
took. Error ``‖y_q − y‖ / ‖y‖`` of the logits.

``--draws N``: one model's error is one draw from a wide distribution — which weights round
up and which down decides much of it at this depth. Each draw multiplies every equalized
pair's channels by an exact random factor ``exp(0.02·N(0, 1))`` after the sweeps (the first
layer's output channels divided, the second's input rows multiplied: the float model is
unchanged, the rounding is not); with ``--sweeps 0`` the same factors on the folded weights.
It reaches into ``hlofold._equalize`` (a measurement tool, not an API).

Run: ``python -m benchmarks.quantization_full [--model resnet50] [--seeds 6] [--draws 0]
[--sweeps N]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

import hlofold
from benchmarks.quantization import quantize, rel_err, spread_gamma


def case(name: str, seed: int):
    import flax.linen as nn

    from benchmarks import models
    if name == "resnet50":
        model, where = models.resnet50(num_classes=1000), "bn"
    else:
        model, where = models.MobileNetV2(num_classes=1000, width_mult=1.0, act=nn.relu), "_dw"
    v = spread_gamma(models.init(model, 224, seed=seed), where, seed)
    x = jax.random.normal(jax.random.key(200 + seed), (2, 224, 224, 3))
    return model.apply, v, x


def with_draws(rng):
    """Patch the equalization so that every pair's scales get an exact random factor after
    the sweeps (see the module's text); returns the undo."""
    from hlofold import _equalize
    from hlofold._core import equalize as core
    orig = _equalize.equalize

    def drawn(values, pairs, pow2=False):
        work, done = orig(values, pairs, pow2)
        for p, d in zip(pairs, done):
            core.apply(work, p, np.exp(0.02 * rng.standard_normal(len(d.scale))))
        return work, done
    _equalize.equalize = drawn
    return lambda: setattr(_equalize, "equalize", orig)


def measure(name: str, seed: int, draws: int) -> list[float]:
    """[folded, equalized, per channel, seconds] — with ``draws``, the equalized error's
    median over that many draws."""
    f, v, x = case(name, seed)
    g = jax.jit(f)
    ref = g(v, x)
    folded = hlofold.fold_params(f, v, x)
    t = time.perf_counter()
    eq = hlofold.fold_params(f, v, x, equalize=True)
    dt = time.perf_counter() - t
    err = [rel_err(ref, g(quantize(eq.params, per_tensor=True), x))]
    for d in range(draws):
        undo = with_draws(np.random.default_rng(d))
        try:
            p = hlofold.fold_params(f, v, x, equalize=True).params
        finally:
            undo()
        err.append(rel_err(ref, g(quantize(p, per_tensor=True), x)))
    if draws:
        print(f"  seed {seed}: {draws} draws " + " ".join(f"{e:.4f}" for e in err[1:]))
    return [rel_err(ref, g(quantize(folded.params, per_tensor=True), x)),
            float(np.median(err[1:] if draws else err)),
            rel_err(ref, g(quantize(folded.params), x)), dt]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50", choices=("resnet50", "mobilenetv2"))
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--draws", type=int, default=0)
    ap.add_argument("--sweeps", type=int, default=None,
                    help="the sweeps' bound (hlofold._core.equalize.SWEEPS) for this run")
    a = ap.parse_args(argv)
    if a.sweeps is not None:
        from hlofold._core import equalize as core
        core.SWEEPS = a.sweeps
    rows = []
    print(f"{a.model}, 224 px, batch 2. Machine: {platform.processor() or platform.machine()}"
          f", {os.cpu_count()} CPUs, jax {jax.__version__}\n")
    print("| seed | per tensor, folded | per tensor, equalized | per channel, folded | "
          "equalized / folded | equalize s |\n|---|---|---|---|---|---|")
    for s in range(a.seeds):
        r = measure(a.model, s, a.draws)
        rows.append(r)
        print(f"| {s} | {r[0]:.4f} | {r[1]:.4f} | {r[2]:.4f} | {r[1] / r[0]:.2f}× | "
              f"{r[3]:.1f} |", flush=True)
    m = np.median(np.asarray(rows), 0)
    ratio = np.median([r[1] / r[0] for r in rows])
    print(f"| median | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} | {ratio:.2f}× | {m[3]:.1f} |")


if __name__ == "__main__":
    main()
