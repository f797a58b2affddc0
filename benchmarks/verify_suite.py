"""Verify folded vs original on every backend present, over the StableHLO test suite and a
folded ResNet, and write the report (Markdown + JSON) with the device named.

    python -m benchmarks.verify_suite [--out docs/verification]
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hlofold
from hlofold import examples
from hlofold._ir.stablehlo.artifacts import input_specs

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "testdata", "stablehlo")


def cases():
    for path in sorted(glob.glob(os.path.join(DATA, "*.mlir"))):
        text = open(path).read()
        folded, _ = hlofold.fold_stablehlo(text)
        rng = np.random.default_rng(0)
        args = [rng.uniform(0.5, 1.5, s.shape).astype(s.dtype) for s in input_specs(text)]
        yield os.path.basename(path), text, folded, args
    p = examples.init_resnet(18, width=16)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64, 64, 3)), jnp.float32)
    yield ("ResNet-18 (params as inputs, Python)", jax.jit(examples.resnet_apply),
           hlofold.fold(examples.resnet_apply), (p, x))
    yield ("ResNet-18 (frozen, Python)", jax.jit(lambda x: examples.resnet_apply(p, x)),
           hlofold.fold(lambda x: examples.resnet_apply(p, x)), (x,))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/verification")
    a = ap.parse_args(argv)
    rows, results = [], []
    for name, orig, folded, args in cases():
        rep = hlofold.verify(orig, folded, *args, raise_on_failure=False)
        results.append({"case": name, **rep.to_dict()})
        for r in rep.rows:
            rows.append(f"| {name} | {r.backend} ({rep.devices[r.backend]}) | {r.against} | "
                        f"{r.output} | {r.dtype} | {r.max_abs:.3e} | {r.max_rel:.3e} | "
                        f"{r.eps_units:.1f} | {r.tolerance:.3e} | "
                        f"{'pass' if r.passed else 'FAIL'} |")
    backends = sorted({b for res in results for b in res["backends"]})
    devices = {b: d for res in results for b, d in res["devices"].items()}
    tag = "_".join(backends)
    os.makedirs(a.out, exist_ok=True)
    stamp = (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
             f"devices: {devices}; jax {jax.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    md = [f"# hlofold verification on {', '.join(backends)}", "", stamp, "",
          "Command: `python -m benchmarks.verify_suite`. Tolerance model: see "
          "`hlofold/_front/verify.py` (eps·(8 + 2·√L)·max|ref|, L = longest accumulation).", "",
          f"All passed: **{all(r['passed'] for r in results)}**", "",
          "| case | backend | against | out | dtype | max abs | max rel | eps units | "
          "tolerance | result |", "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    with open(os.path.join(a.out, f"{tag}.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(a.out, f"{tag}.json"), "w") as f:
        json.dump({"stamp": stamp, "results": results}, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
