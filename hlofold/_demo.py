"""``hlofold demo``: fold a built-in ResNet with realistic BatchNorm statistics and show the
report, the StableHLO of one block before and after, the numeric check, and a latency
comparison with plain ``jax.jit``.
"""
from __future__ import annotations

import sys
import time


def _progress(step: int, total: int, what: str):
    print(f"[{step}/{total}] {what} ...", file=sys.stderr, flush=True)


def _block_excerpt(text: str, lines_after: int = 7) -> str:
    """The first convolution of a StableHLO module and the ops that follow it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "stablehlo.convolution" in line:
            chunk = lines[i:i + lines_after]
            return "\n".join(l.strip()[:150] for l in chunk)
    return "(no convolution found)"


def demo(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hlofold
    from hlofold import examples

    total = 5
    t_start = time.perf_counter()
    _progress(1, total, f"building ResNet-{args.depth} (width {args.width}) with realistic "
                        "BN statistics")
    params = examples.init_resnet(args.depth, width=args.width, seed=0)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (args.batch, args.size, args.size, 3)), jnp.float32)
    unfolded = jax.jit(examples.resnet_apply)
    folded = hlofold.fold(unfolded)
    frozen = hlofold.fold(examples.resnet_apply, freeze="params")

    _progress(2, total, "tracing and folding")
    t0 = time.perf_counter()
    report = folded.report(params, x)
    t_fold = time.perf_counter() - t0
    print(f"\n== Fold report (params as inputs; traced and folded in {t_fold:.2f} s) ==")
    print(report)

    _progress(3, total, "lowering to StableHLO")
    before = unfolded.lower(params, x).as_text()
    after = frozen.lower(params, x).as_text()
    print("\n== StableHLO of the first block, before (conv, then BN arithmetic) ==")
    print(_block_excerpt(before))
    print("\n== ... and after folding with frozen params (conv with a folded constant "
          "kernel, then one add) ==")
    print(_block_excerpt(after, 4))
    print(f"\nops in the module: before {before.count(' = stablehlo.')}, "
          f"after {after.count(' = stablehlo.')}")

    _progress(4, total, "checking numerics")
    from ._core.tolerance import compare
    from ._jaxpr.accumulation import tolerance_profile
    acc, depth, compute = tolerance_profile(folded.original_jaxpr(params, x).jaxpr)
    ref = np.asarray(unfolded(params, x))
    print("\n== Numeric check against the unfolded program (same backend: "
          f"{jax.default_backend()}; hlofold's tolerance model, L = {acc}, D = {depth}) ==")
    ok = True
    for name, fn in (("folded (params as inputs)", folded), ("folded (frozen)", frozen)):
        c = compare(ref, np.asarray(fn(params, x)), acc, depth, compute=compute)
        ok &= c.why is None
        print(f"  {name:28s} max|Δ| = {c.max_abs:.3e}  (bound {c.bound:.3e})  "
              f"{'PASS' if c.why is None else 'FAIL: ' + c.why}")

    if args.rounds > 0:
        _progress(5, total, f"timing, {args.rounds} interleaved rounds")
        variants = {"unfolded": lambda: unfolded(params, x),
                    "folded, params as inputs": lambda: folded(params, x),
                    "folded, frozen": lambda: frozen(params, x)}
        for fn in variants.values():
            jax.block_until_ready(fn())
        samples = {k: [] for k in variants}
        for _ in range(args.rounds):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                samples[k].append(time.perf_counter() - t0)
        base = float(np.median(samples["unfolded"]))
        print(f"\n== Latency, batch {args.batch}, {args.size}x{args.size} "
              f"(median of {args.rounds}; a quick look — see benchmarks/ for the real thing) ==")
        for k, v in samples.items():
            med = float(np.median(v))
            print(f"  {k:28s} {med * 1e3:8.2f} ms   ×{med / base:.2f} of unfolded")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return 0 if ok else 1
