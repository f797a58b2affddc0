"""Where per-tensor int8 error stays above per-channel after equalization: the equalized
weights quantized with one scale per tensor except one group of kernels with a scale per
output channel — the stream writers, the stream readers, the pairs' first or second kernels —
each seed's error the median over rounding draws (``quantization_full.drawn``).

``python -m benchmarks.quantization_attribution [--model resnet18-32] --seeds 3 --draws 2``
(the numbers in ``docs/quantization.md``, "Per-tensor after equalization is still not at
per-channel").
"""
from __future__ import annotations

import argparse
import os
import platform

import jax
import numpy as np

import hlofold
from benchmarks.quantization import quantize, rel_err
from benchmarks.quantization_full import case, drawn


def groups(eq, params) -> dict:
    """Kernel paths by their part in ``eq``'s records."""
    writers, readers, first, second = set(), set(), set(), set()
    for e in eq.equalized:
        if e.writers:
            writers |= {e.first, *e.writers}
            readers |= set(e.seconds)
        else:
            first.add(e.first)
            second |= set(e.seconds)
    every = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
             if jax.tree_util.keystr(p).endswith("['kernel']")}
    return {"none": set(), "stream writers": writers, "stream readers": readers,
            "pairs' first": first, "pairs' second": second, "every kernel": every}


def mixed(tree, per_channel: set):
    """Every kernel per tensor, those in ``per_channel`` (paths) per output channel."""
    t, c = quantize(tree, True), quantize(tree, False)
    return jax.tree_util.tree_map_with_path(
        lambda p, a, b: b if jax.tree_util.keystr(p) in per_channel else a, t, c)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18-32")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--draws", type=int, default=2)
    a = ap.parse_args(argv)
    rows: dict = {}
    for seed in range(a.seeds):
        f, v, x = case(a.model, seed)
        g = jax.jit(f)
        ref = g(v, x)
        sets = groups(hlofold.fold_params(f, v, x, equalize=True), v)
        per_seed: dict = {}
        for d in range(a.draws):
            p = drawn(f, v, x, np.random.default_rng(d))
            for k, paths in sets.items():
                per_seed.setdefault(k, []).append(rel_err(ref, g(mixed(p, paths), x)))
        for k, errs in per_seed.items():
            rows.setdefault(k, (len(sets[k]), []))[1].append(float(np.median(errs)))
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__}; {a.model}, {a.seeds} seeds x {a.draws} draws (median)\n")
    print("| per channel | kernels | error (per tensor elsewhere) |\n|---|---|---|")
    for k, (n, errs) in rows.items():
        print(f"| {k} | {n} | {np.median(errs):.4f} |")


if __name__ == "__main__":
    main()
