"""Instructions per StableHLO fold, counted by callgrind: a figure the machine's noise does
not move.

``python -m benchmarks.foldcount [--against DIR] [--sites N] [--decoder L]`` runs, for this
checkout (and ``DIR``, another checkout's ``hlofold``), ``fold_stablehlo`` on the module of
:mod:`benchmarks.foldtime` (``N`` conv → BN blocks, 5 ops each; default 1,000) under
``valgrind --tool=callgrind``, once with one fold and once with none; the difference is
the instructions of one fold (parse, fold, print), in each mode: weights as constants,
as arguments (default), as arguments with ``in_graph=True``. With ``--decoder L``: the
``L``-layer decoder of issue 30 (``benchmarks.foldtime.write_decoders``) instead, default
and ``in_graph=True``, next to parsing and printing the same module (doing nothing). Instruction counts leave out
what time also sees (cache misses, page faults), so they complement ``benchmarks.foldtime``,
they do not replace it; on the project's shared VM, where timings move by ±30 % from run to
run, they tell whether a change made the fold do less work. Needs valgrind (not a test
dependency; takes a few minutes per checkout).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import hlofold
assert hlofold.__file__.startswith(sys.argv[1]), hlofold.__file__
from tests.helpers.modules import huge_module
mode, folds, source = sys.argv[3], int(sys.argv[4]), sys.argv[5]
text = huge_module(int(source), constants=mode == "constants") if source.isdigit() else \
    open(source).read()
kw = {"in_graph": True} if mode == "in_graph=True" else {}
if mode == "parse + print":
    from hlofold import _compat
    from jax._src.lib.mlir import ir

    def run(t):
        with _compat.mlir_context():
            return str(ir.Module.parse(t))
else:
    def run(t):
        return hlofold.fold_stablehlo(t, **kw)
run(huge_module(10))       # first-use setup: not counted
for _ in range(folds):
    run(text)
"""

MODES = ("constants", "default", "in_graph=True")


def _count(checkout: str, here: str, mode: str, folds: int, source) -> int:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        got = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             "-c", _CHILD, checkout, here, mode, str(folds), str(source)],
            capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        m = re.search(r"Collected : (\d+)", got.stderr)
        if got.returncode or not m:
            raise SystemExit(f"counting {checkout} ({mode}) failed:\n{got.stderr[-3000:]}")
        return int(m.group(1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another hlofold checkout to count the same way")
    ap.add_argument("--sites", type=int, default=1000)
    ap.add_argument("--decoder", type=int, help="count the L-layer decoder's folds instead")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("benchmarks.foldcount needs valgrind")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = [here] + ([os.path.abspath(args.against)] if args.against else [])
    source, modes = args.sites, MODES
    if args.decoder:
        from benchmarks.foldtime import write_decoders
        folder = tempfile.mkdtemp()
        write_decoders(folder, (args.decoder,))
        source = os.path.join(folder, f"decoder_{args.decoder}.mlir")
        modes = ("parse + print", "default", "in_graph=True")
        print(f"instructions per fold_stablehlo of the {args.decoder}-layer decoder (callgrind)")
    else:
        print(f"instructions per fold_stablehlo of {5 * args.sites} ops (callgrind)")
    print("| mode | " + " | ".join(os.path.basename(c) or c for c in checkouts) + " |")
    print("|---|" + "---|" * len(checkouts))
    for mode in modes:
        cells = []
        for c in checkouts:
            try:
                one = _count(c, here, mode, 1, source) - _count(c, here, mode, 0, source)
                cells.append(f"{one / 1e6:.0f} M")
            except SystemExit:         # a mode the other checkout does not have
                cells.append("—")
        print(f"| {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
