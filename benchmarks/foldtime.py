"""How long hlofold itself takes to fold, next to another checkout of hlofold.

``python -m benchmarks.foldtime [--against DIR] [--rounds N] [--quick]`` times, in one
process per checkout and round (checkouts interleaved round by round, so machine noise
falls on both):

* next to doing nothing: ``jax.make_jaxpr`` of the network (the trace every fold starts
  from) and parsing and printing the StableHLO module without folding it;
* ``fold_jaxpr`` on Flax ResNet-50 (64 px) with its parameters as inputs, in each
  ``in_graph`` mode (``never``: the default of traced calls, ``prepared``, ``guarded``) and
  with its parameters as constants (``K ⊙ s`` computed on the host; the process's first
  fold, which pays for fresh memory pages and any first-use setup, and later ones);
* ``fold_stablehlo`` on a 10,000-op module (2,000 conv → BN blocks) with its weights as
  arguments (default: left unfolded; ``in_graph=True``: folded in the graph, guarded) and as
  constants;
* ``fold_stablehlo`` on Llama-style decoders of 8, 32 and 96 layers (``hlofold.examples``,
  d = 64, weights as arguments; made by this checkout, so both checkouts fold the same
  modules), next to parsing and printing each (``str`` of the parsed module, as issue 30
  measured it; and the fastest round trip the bindings offer: printed as bytes, without the
  verification ``str`` runs first): how fold time grows with depth.

``--against DIR``: a checkout (e.g. ``git worktree add /tmp/old <commit>``) whose
``hlofold`` is timed the same way; modes it does not have are skipped. Each figure is the
median of the per-round medians with [min–max]. This measures the transform, not the
program it produces (``benchmarks.calls`` does that).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import inspect, json, sys, time, statistics
sys.path.insert(0, sys.argv[2])
from benchmarks import models as M        # this checkout's models, the other's hlofold
sys.path.insert(0, sys.argv[1])
import jax, numpy as np, hlofold
assert hlofold.__file__.startswith(sys.argv[1]), hlofold.__file__
quick = sys.argv[3] == "1"
out = {}

def timed(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

name = "resnet18" if quick else "resnet50"
model, _, variables, _ = M.build(name, image_size=32 if quick else 64)
x = np.zeros((1, 32 if quick else 64, 32 if quick else 64, 3), np.float32)
traced = jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x)
consts = jax.make_jaxpr(lambda x: model.apply(variables, x))(x)
out[f"doing nothing: jax.make_jaxpr of {name} (the trace a fold starts from)"] = timed(
    lambda: jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x), 3)
modes = ("never", "prepared", "guarded") if "in_graph" in inspect.signature(
    hlofold.fold_jaxpr).parameters else ("",)
for mode in modes:
    kw = {"in_graph": mode} if mode else {}
    hlofold.fold_jaxpr(traced, **kw)
    out[f"jaxpr {name} params as inputs, {mode or 'in graph'}"] = timed(
        lambda: hlofold.fold_jaxpr(traced, **kw), 5)
out[f"jaxpr {name} params as constants, the process's first fold"] = timed(
    lambda: hlofold.fold_jaxpr(consts), 1)
out[f"jaxpr {name} params as constants"] = timed(lambda: hlofold.fold_jaxpr(consts), 3)

if not hasattr(hlofold, "fold_stablehlo"):
    print(json.dumps(out))
    sys.exit(0)
sys.path.insert(0, sys.argv[2])
from tests.helpers.modules import huge_module
n = 200 if quick else 2000
text = huge_module(n)
ktext = huge_module(n, constants=True)
from jaxlib.mlir import ir
from hlofold import _compat


def _pp(t):
    with _compat.mlir_context():
        return str(ir.Module.parse(t))


def _pp_bytes(t):     # the fastest round trip: printed as bytes, not verified again
    with _compat.mlir_context():
        return ir.Module.parse(t).operation.get_asm(binary=True,
                                                    assume_verified=True).decode()


def round_trip():
    return _pp(text)


out[f"doing nothing: parse and print the {5 * n}-op module"] = timed(round_trip, 2)
has_flag = "in_graph" in inspect.signature(hlofold.fold_stablehlo).parameters
runs = [("weights as arguments, default", text, {})]
if has_flag:
    runs.append(("weights as arguments, in_graph=True", text, {"in_graph": True}))
runs.append(("weights as constants", ktext, {}))
for label, t, kw in runs:
    hlofold.fold_stablehlo(huge_module(10), **kw)
    out[f"stablehlo {5 * n} ops, {label}"] = timed(lambda: hlofold.fold_stablehlo(t, **kw), 2)
# deep decoders (weights as arguments), written by the parent process with its examples
import glob, os
for path in sorted(glob.glob(os.path.join(sys.argv[4], "decoder_*.mlir")),
                   key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0])):
    layers = int(path.rsplit("_", 1)[1].split(".")[0])
    t = open(path).read()
    ops = t.count(" = ")
    out[f"doing nothing: parse and print the {layers}-layer decoder ({ops} ops)"] = timed(
        lambda: _pp(t), 3)
    out[f"doing nothing, fastest: parse and print as bytes, the {layers}-layer decoder"] = \
        timed(lambda: _pp_bytes(t), 3)
    for label, kw in (("weights as arguments, default", {}),
                      ("weights as arguments, in_graph=True", {"in_graph": True})):
        if kw and not has_flag:
            continue
        out[f"stablehlo {layers}-layer decoder, {label}"] = timed(
            lambda: hlofold.fold_stablehlo(t, **kw), 3)
print(json.dumps(out))
"""


def _one(checkout: str, here: str, quick: bool, modules: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    got = subprocess.run([sys.executable, "-c", _CHILD, checkout, here, "1" if quick else "0",
                          modules], capture_output=True, text=True, env=env)
    if got.returncode:
        raise SystemExit(f"timing {checkout} failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def write_decoders(folder: str, depths) -> None:
    """The Llama-style decoder of ``hlofold.examples`` (d = 64), lowered with its weights as
    module arguments, one module per depth (issue 30's modules)."""
    import jax
    import jax.numpy as jnp
    from hlofold import examples
    tokens = jnp.zeros((1, 8), jnp.int32)
    for layers in depths:
        text = jax.jit(examples.decoder_apply).lower(
            examples.init_decoder(layers, d=64), tokens).as_text()
        with open(os.path.join(folder, f"decoder_{layers}.mlir"), "w") as f:
            f.write(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another hlofold checkout to time the same way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small models, one round")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = [here] + ([os.path.abspath(args.against)] if args.against else [])
    rounds = 1 if args.quick else args.rounds
    samples: dict = {c: {} for c in checkouts}
    modules = tempfile.mkdtemp()
    write_decoders(modules, (2, 8) if args.quick else (8, 32, 96))
    for _ in range(rounds):
        for c in checkouts:
            for k, v in _one(c, here, args.quick, modules).items():
                samples[c].setdefault(k, []).append(v)
    from .common import machine_info, machine_line
    print(f"fold time, {rounds} round(s), {machine_line(machine_info())}")
    keys = list(dict.fromkeys(k for c in checkouts for k in samples[c]))
    print("| what | " + " | ".join(os.path.basename(c) or c for c in checkouts) + " |")
    print("|---|" + "---|" * len(checkouts))
    for k in keys:
        cells = []
        for c in checkouts:
            v = samples[c].get(k)
            cells.append("—" if not v else
                         f"{1e3 * statistics.median(v):.1f} ms [{1e3 * min(v):.1f}–"
                         f"{1e3 * max(v):.1f}]")
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
