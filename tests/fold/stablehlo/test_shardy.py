"""Sharded StableHLO (Shardy's ``sdy`` dialect) on every StableHLO path (issue 40, item 1).

The checks run in ``tests/fold/stablehlo/_shardy_script.py`` in a subprocess: 8 host devices must be
set before JAX starts (this process runs on 1). Here: the structural facts that need no mesh.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def run_script(*checks: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return subprocess.run([sys.executable, "-m", "tests.fold.stablehlo._shardy_script", *checks],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("checks", [("conv", "manual", "residual"),
                                    pytest.param(("decoder",), marks=pytest.mark.slow),
                                    pytest.param(("stack",), marks=pytest.mark.slow)],
                         ids=["conv-manual-residual", "decoder", "scanned-stack"])
def test_sharded_modules_fold_on_every_path_and_run_sharded(checks):
    """In the graph, params=, split=, a sharded jax.export with params=, the CLI; a conv → BN
    net with a sharding constraint, a decoder, and a shard_map body: the folded modules keep
    sdy.mesh, prepared weights take their origin's sharding, and they run on a 4 × 2 mesh
    with the original's outputs and output sharding. The decoder and the scanned stack are
    smoothed too (smooth=, its calibration run here: a loop's layers one by one) and run
    sharded with the original's outputs; residual stages are equalized with their streams
    (equalize=) and run sharded."""
    proc = run_script(*checks)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for name in checks:
        assert f"ok {name}:" in proc.stdout, proc.stdout


def test_a_sharded_modules_prepared_weights_take_their_origins_sharding():
    import numpy as np

    import hlofold
    text = _SHARDED
    rng = np.random.default_rng(0)
    apply, rep, prepared = hlofold.fold_stablehlo(text, params={
        "arg1": rng.normal(size=(3, 3, 4, 4)).astype(np.float32),
        "arg2": rng.normal(size=4).astype(np.float32)})
    main = [l for l in apply.splitlines() if "func.func public @main" in l][0]
    assert rep.num_folded == 1 and "sdy.mesh @mesh" in apply
    # %arg1 (the folded kernel K ⊙ s) as the kernel
    assert len(prepared) == 1 and ('%arg1: tensor<3x3x4x4xf32> {sdy.sharding = '
                                   '#sdy.sharding<@mesh, [{}, {}, {}, {"model"}]>}') in main
    _, _, prep = hlofold.fold_stablehlo(text, split=["arg0"])
    assert ('-> (tensor<3x3x4x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}, '
            '{"model"}]>}, tensor<i1>)') in prep


_SHARDED = """
module @jit_net attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=4, "model"=2]>
  func.func public @main(%arg0: tensor<2x8x8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}, {}, {}]>}, %arg1: tensor<3x3x4x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}, {"model"}]>}, %arg2: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"model"}]>}) -> (tensor<2x8x8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}, {}, {"model"}]>}) {
    %0 = stablehlo.convolution(%arg0, %arg1) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x8x8x4xf32>, tensor<3x3x4x4xf32>) -> tensor<2x8x8x4xf32>
    %1 = stablehlo.broadcast_in_dim %arg2, dims = [3] : (tensor<4xf32>) -> tensor<2x8x8x4xf32>
    %2 = stablehlo.multiply %0, %1 : tensor<2x8x8x4xf32>
    %3 = sdy.sharding_constraint %2 <@mesh, [{"data"}, {}, {}, {}]> : tensor<2x8x8x4xf32>
    return %3 : tensor<2x8x8x4xf32>
  }
}
"""
