"""``hlofold demo``: fold a built-in ResNet with realistic BatchNorm statistics and show the
report, the StableHLO of one block before and after, the numeric check, and a latency
comparison with plain ``jax.jit`` — of the ResNet, and of a RepVGG stack whose parallel
branches merge (next to its deploy form written by hand). Where this JAX switched a fold off,
it says so and shows the original program.
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


def _time(variants: dict, rounds: int) -> dict:
    """Median seconds per call of each variant, over ``rounds`` interleaved rounds (each
    variant called once before, so compiles are not timed)."""
    import jax
    import numpy as np
    for fn in variants.values():
        jax.block_until_ready(fn())
    samples: dict = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in samples.items()}


def _print_times(medians: dict, base: str) -> None:
    for k, med in medians.items():
        print(f"  {k:36s} {med * 1e3:8.2f} ms   ×{med / medians[base]:.2f} of {base}")


def demo(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hlofold
    from hlofold import examples
    from hlofold import _compat as C

    total = 5
    t_start = time.perf_counter()
    print(f"hlofold on jax {jax.__version__} ({jax.default_backend()})")
    off = C.disabled("jaxpr")
    if off is not None:
        print(f"NOTE: {off}. The steps below run and show the original program.")
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
          "kernel, then one add) ==" if off is None else
          "\n== ... and with hlofold.fold (folding is off on this JAX: the same) ==")
    print(_block_excerpt(after, 4))
    print(f"\nops in the module: before {before.count(' = stablehlo.')}, "
          f"after {after.count(' = stablehlo.')}")

    _progress(4, total, "checking numerics")
    from hlofold._base.tolerance import compare
    from hlofold._fold.jaxpr.accumulation import tolerance_profile
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
        print(f"\n== Latency, batch {args.batch}, {args.size}x{args.size} (median of "
              f"{args.rounds}; a quick look — see benchmarks/ for the real thing) ==")
        print(f"ResNet-{args.depth}: XLA:CPU already fuses the BN epilogue, so folding "
              f"mostly saves nothing here")
        _print_times(_time({"jax.jit": lambda: unfolded(params, x),
                            "hlofold.fold, params as inputs": lambda: folded(params, x),
                            "hlofold.fold, frozen": lambda: frozen(params, x)},
                           args.rounds), "jax.jit")
        rep_p = examples.init_repvgg(4, width=args.width, in_channels=16)
        deploy_p = examples.repvgg_deploy(rep_p)
        xr = jnp.asarray(np.random.default_rng(1).standard_normal(
            (args.batch, args.size, args.size, 16)), jnp.float32)
        train = jax.jit(examples.repvgg_apply)
        merged = hlofold.fold(examples.repvgg_apply)
        deploy = jax.jit(examples.repvgg_deploy_apply)
        mrep = merged.report(rep_p, xr)
        print(f"RepVGG, 4 blocks of width {args.width} (three parallel branches per block "
              f"summed: {len(mrep.merged)} sums merged into one 3×3 conv each):")
        _print_times(_time({"jax.jit (train-time form)": lambda: train(rep_p, xr),
                            "hlofold.fold (train-time form)": lambda: merged(rep_p, xr),
                            "jax.jit (deploy form, by hand)": lambda: deploy(deploy_p, xr)},
                           args.rounds), "jax.jit (train-time form)")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return 0 if ok else 1
