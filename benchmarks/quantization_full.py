"""Cross-layer equalization at the sizes users run (issue 51), and measured over rounding
draws: ResNet-50 and a width-1.0 MobileNetV2-style net at 224 px, batch 2, every BN's γ
(ResNet-50) or the depthwise BNs' γ (MobileNetV2) spread over two decades as in
``benchmarks/quantization.py --equalize`` (whose 32 px nets are ``--model resnet18-32`` and
``mobilenetv2-32`` here).

Per seed: per-tensor int8 error of the folded weights, of the folded + equalized ones, and
per-channel int8 of the folded weights (the plain quantizer of
``benchmarks.quantization.quantize``), with the time ``fold_params(..., equalize=True)``
took. Error ``‖y_q − y‖ / ‖y‖`` of the logits.

``--draws N``: one model's error is one draw from a wide distribution — which weights round
up and which down decides much of it. Each draw multiplies every pair's channels by an
exact random factor ``exp(0.02·N(0, 1))`` (the first layer's output channels divided, the
second's input rows multiplied: the float model is unchanged, the rounding is not), after
the sweeps for the equalized column and with no sweeps for the folded ones; each column is
the median over the draws. It reaches into ``hlofold._quant.jaxpr.rewrite`` (a measurement tool, not an
API).

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
    from benchmarks.quantization import equalize_case
    if name.endswith("-32"):               # the 32 px rows of ``quantization --equalize``
        return equalize_case(name[:-3], seed)
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
    from hlofold._quant.jaxpr import rewrite as _equalize
    from hlofold._quant.core import equalize as core
    orig = _equalize.equalize

    def patched(values, pairs, pow2=False):
        work, done = orig(values, pairs, pow2)
        for p, d in zip(pairs, done):
            core.apply(work, p, np.exp(0.02 * rng.standard_normal(len(d.scale))))
        return work, done
    _equalize.equalize = patched
    return lambda: setattr(_equalize, "equalize", orig)


def with_smoothing_draws(rng):
    """Patch SmoothQuant's rule so that every pair's scales get an exact random factor
    ``exp(0.02·N(0,1))`` (the float model unchanged: any smoothing scale is exact; which
    weights and activations round up or down changes); returns the undo. For
    ``benchmarks.quantization --smooth --draws``."""
    from hlofold._quant.core import smooth as sq
    orig = sq.smoothing

    def patched(xmax, wmax, alpha, pow2=False):
        s = orig(xmax, wmax, alpha) * np.exp(0.02 * rng.standard_normal(np.shape(xmax)))
        return sq.powers_of_two(s) if pow2 else s
    sq.smoothing = patched
    return lambda: setattr(sq, "smoothing", orig)


def drawn(f, v, x, rng, sweeps=None):
    """``fold_params(..., equalize=True)``'s parameters with one draw's factors after the
    sweeps (``sweeps=0``: none run — the folded weights with the draw's factors)."""
    from hlofold._quant.core import equalize as core
    undo, bound = with_draws(rng), core.SWEEPS
    core.SWEEPS = bound if sweeps is None else sweeps
    try:
        return hlofold.fold_params(f, v, x, equalize=True).params
    finally:
        undo()
        core.SWEEPS = bound


def measure(name: str, seed: int, draws: int) -> list[float]:
    """[folded per tensor, equalized per tensor, folded per channel, seconds] — with
    ``draws``, each the median over that many draws (the folded weights drawn too)."""
    f, v, x = case(name, seed)
    g = jax.jit(f)
    ref = g(v, x)
    t = time.perf_counter()
    eq = hlofold.fold_params(f, v, x, equalize=True)
    dt = time.perf_counter() - t
    err = lambda p, per_tensor=True: rel_err(ref, g(quantize(p, per_tensor), x))  # noqa: E731
    if not draws:
        folded = hlofold.fold_params(f, v, x).params
        return [err(folded), err(eq.params), err(folded, False), dt]
    rows = []
    for d in range(draws):
        folded = drawn(f, v, x, np.random.default_rng(d), sweeps=0)
        rows.append([err(folded), err(drawn(f, v, x, np.random.default_rng(d))),
                     err(folded, False)])
    a = np.asarray(rows)
    print(f"  seed {seed}, {draws} draws: folded " + " ".join(f"{e:.4f}" for e in a[:, 0]) +
          "; equalized " + " ".join(f"{e:.4f}" for e in a[:, 1]))
    return [*np.median(a, 0), dt]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50", choices=(
        "resnet50", "mobilenetv2", "resnet18-32", "mobilenetv2-32"))
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--draws", type=int, default=0)
    ap.add_argument("--sweeps", type=int, default=None,
                    help="the sweeps' bound (hlofold._quant.core.equalize.SWEEPS) for this run")
    a = ap.parse_args(argv)
    if a.sweeps is not None:
        from hlofold._quant.core import equalize as core
        core.SWEEPS = a.sweeps
    rows = []
    size = "32 px, batch 8" if a.model.endswith("-32") else "224 px, batch 2"
    machine = platform.processor() or platform.machine()
    print(f"{a.model}, {size}, {a.draws or 'no'} draws. Machine: {machine}"
          f", {os.cpu_count()} CPUs, jax {jax.__version__}\n")
    print("| seed | per tensor, folded | per tensor, equalized | per channel, folded | "
          "equalized / folded | equalized / per channel | equalize s |\n"
          "|---|---|---|---|---|---|---|")
    for s in range(a.seeds):
        r = measure(a.model, s, a.draws)
        rows.append(r)
        print(f"| {s} | {r[0]:.4f} | {r[1]:.4f} | {r[2]:.4f} | {r[1] / r[0]:.2f}× | "
              f"{r[1] / r[2]:.2f}× | {r[3]:.1f} |", flush=True)
    m = np.median(np.asarray(rows), 0)
    ratio = lambda j: np.median([r[1] / r[j] for r in rows])      # noqa: E731
    print(f"| median | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} | {ratio(0):.2f}× | "
          f"{ratio(2):.2f}× | {m[3]:.1f} |")


if __name__ == "__main__":
    main()
