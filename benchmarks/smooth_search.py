"""Smoothing's α fixed (0.5) against α searched per pair (``alpha="search:wNaM"``), under
the plain quantizer (weights per output channel, activations per tensor, or weights only
with ``a16``), in the same run as the original and the folded model: relative L2 error of
the outputs, the median over seeds.

    python -m benchmarks.smooth_search [--seeds 5] [--cases decoder,flax_rms,...] [--qwix]

``--qwix``: Qwix's PTQ (int8 or int4 weights, int8 activations or none) in place of the
plain quantizer, on the Flax models (Qwix quantizes Flax modules).
"""
from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

import hlofold
from benchmarks.quantization import rel_err, smooth_case, wxa8

CASES = ("decoder", "flax_rms", "flax_ln", "RMSNorm", "LayerNorm")
TARGETS = ((8, 8), (4, 8), (4, 16))


def errors(name: str, seed: int, wbits: int, abits: int, qwix: bool = False) -> list[float]:
    """original, folded, α 0.5, α searched for ``w{wbits}a{abits}``; the search's seconds."""
    f, p, x, calib = smooth_case(name, seed, block_seed=seed)
    ref = f(p, *x)
    run = lambda t: rel_err(ref, wxa8(f, t, *x, wbits=wbits, abits=abits))  # noqa: E731
    if qwix:
        import jax.numpy as jnp

        from benchmarks.quantization import qwix_ptq
        q = qwix_ptq(f, x[0], jnp.int8 if wbits == 8 else jnp.int4,
                     None if abits == 16 else jnp.int8)
        run = lambda t: rel_err(ref, q(t))                                     # noqa: E731
    fixed = hlofold.fold_params(f, p, *x, smooth=calib)
    t0 = time.perf_counter()
    found = hlofold.fold_params(f, p, *x, smooth=calib, alpha=f"search:w{wbits}a{abits}")
    took = time.perf_counter() - t0
    assert rel_err(ref, f(found.params, *x)) < 1e-5             # exact in float
    return [run(p), run(hlofold.fold_params(f, p, *x).params), run(fixed.params),
            run(found.params), took]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--qwix", action="store_true", help="Qwix's PTQ (the Flax models)")
    args = ap.parse_args(argv)
    print(f"# {platform.machine()} {platform.processor() or ''}, jax {jax.__version__}, "
          f"{jax.devices()[0].platform}; median over {args.seeds} seeds; "
          f"{'Qwix PTQ' if args.qwix else 'the plain quantizer'}")
    print("| model | quantization | original | folded | α 0.5 | α searched | searched / α 0.5 "
          "| search s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        for wb, ab in TARGETS:
            m = np.median([errors(name, s, wb, ab, args.qwix) for s in range(args.seeds)], 0)
            print(f"| {name} | w{wb}a{ab} | {m[0]:.4g} | {m[1]:.4g} | {m[2]:.4g} | "
                  f"{m[3]:.4g} | {m[3] / m[2]:.2f}× | {m[4]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
