"""What folding does to int8 weight quantization (issue 12, item 3).

Per-output-channel symmetric int8 quantization of every conv/Dense kernel (``scale =
max|W|/127`` per output channel, round to nearest), once on the model's own weights (the
normalizations stay in float) and once on the weights :func:`hlofold.fold_params` wrote
back. Error of each against the float model, ``‖y_q − y‖ / ‖y‖`` on random inputs, median
and range over seeds.

* BN CNN: Flax ResNet-18 (``benchmarks/models.py``, realistic BN statistics), 32 px.
* Transformer block: Flax linen pre-norm block (``tests/helpers/blocks.py``), LayerNorm and
  RMSNorm, with γ drawn log-normal with spread σ_γ (real LLM norms have outlier channels).

Run: ``python -m benchmarks.quantization [--seeds 5] [--qwix] [--out FILE]`` (``--qwix``:
Qwix's post-training quantization, int8 weights and activations, in place of the weight
quantizer).
"""
from __future__ import annotations

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hlofold


def quantize(tree):
    """Every ``kernel`` leaf quantized per output channel (Flax: the last axis)."""
    def q(path, w):
        if "kernel" not in jax.tree_util.keystr(path) or w.ndim < 2:
            return w
        w = np.asarray(w, np.float64)
        scale = np.max(np.abs(w), axis=tuple(range(w.ndim - 1)), keepdims=True) / 127
        scale = np.where(scale == 0, 1, scale)
        return jnp.asarray(np.clip(np.round(w / scale), -127, 127) * scale, jnp.float32)
    return jax.tree_util.tree_map_with_path(q, tree)


def rel_err(ref, out) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure(f, params, x):
    """(error unfolded-quantized, error folded-quantized, folds written back)."""
    ref = f(params, x)
    folded = hlofold.fold_params(f, params, x)
    return (rel_err(ref, f(quantize(params), x)),
            rel_err(ref, f(quantize(folded.params), x)), len(folded.changes))


def qwix_ptq(f, x):
    """Qwix's post-training quantization of the Flax linen model behind ``f`` (its bound
    ``apply``): int8 weights and int8 activations (w8a8, Qwix's rule for every module);
    returns ``variables -> outputs`` of the quantized model, the weights quantized by
    ``qwix.quantize_params``."""
    import qwix
    rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)]
    ptq = qwix.quantize_model(f.__self__, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]

    def run(variables):
        q = qwix.quantize_params(variables["params"], abstract)
        return ptq.apply({**variables, "params": q}, x)
    return run


def measure_qwix(f, params, x):
    """:func:`measure` with Qwix's w8a8 PTQ in place of the per-channel weight quantizer."""
    ref = f(params, x)
    folded = hlofold.fold_params(f, params, x)
    run = qwix_ptq(f, x)
    return rel_err(ref, run(params)), rel_err(ref, run(folded.params)), len(folded.changes)


def cnn_case(seed):
    from benchmarks import models
    model, _, variables, _ = models.build("resnet18", image_size=32, num_classes=10,
                                          width=16, seed=seed)
    x = jax.random.normal(jax.random.key(100 + seed), (4, 32, 32, 3))
    return model.apply, variables, x


def block_case(kind, spread, seed):
    import flax.linen as nn

    from tests.helpers.blocks import X, flax_linen_block
    f, v = flax_linen_block(getattr(nn, kind))
    rng = np.random.default_rng(seed)

    def norm(path, a):
        p = jax.tree_util.keystr(path)
        if "Norm" in p and p.endswith("['scale']"):
            return jnp.asarray(np.exp(spread * rng.standard_normal(a.shape)), a.dtype)
        if "Norm" in p and p.endswith("['bias']"):
            return jnp.zeros_like(a)       # no β: every projection folds (K has no bias)
        return a
    v = jax.tree_util.tree_map_with_path(norm, v)
    x = jnp.asarray(rng.standard_normal((8,) + X.shape[1:]), jnp.float32)
    return f, v, x


def summarize(rows):
    a = np.asarray(rows)
    med, lo, hi = np.median(a, 0), a.min(0), a.max(0)
    return (f"{med[0]:.2e} ({lo[0]:.2e}–{hi[0]:.2e}) | {med[1]:.2e} ({lo[1]:.2e}–{hi[1]:.2e})"
            f" | {med[1] / med[0]:.2f}× | {int(med[2])}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--qwix", action="store_true",
                    help="quantize with Qwix's PTQ (w8a8) instead of the weight quantizer")
    a = ap.parse_args(argv)
    seeds = range(a.seeds)
    how = measure_qwix if a.qwix else measure
    what = "Qwix w8a8 error" if a.qwix else "int8 error"
    lines = [f"| model | {what}, unfolded weights | {what}, folded weights | "
             "folded/unfolded | sites folded |", "|---|---|---|---|---|"]
    lines.append("| ResNet-18 (BN), width 16, 32 px | " +
                 summarize([how(*cnn_case(s)) for s in seeds]) + " |")
    for kind in ("LayerNorm", "RMSNorm"):
        for spread in (0.1, 0.5, 1.0):
            lines.append(f"| block, {kind}, σ_γ = {spread} | " + summarize(
                [how(*block_case(kind, spread, s)) for s in seeds]) + " |")
    head = (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"jax {jax.__version__} ({jax.default_backend()}), {a.seeds} seeds "
            "(median, range).\n\n")
    text = head + "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
