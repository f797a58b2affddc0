"""Issue 40, the fourth adversarial round, on the JAX side: one rule for low precision
(item 3). Sharded artifacts: ``tests/fold/stablehlo/test_shardy.py``; composites and the CLI:
``tests/fold/stablehlo/test_composites.py``."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._base import tolerance as T
from hlofold._fold.jaxpr.accumulation import accumulation_of, computes_in


def _decoder():
    p = examples.init_decoder(2, d=64, dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    return examples.decoder_apply, p, tokens


def _cnn():
    """A bf16 ResNet-10 whose logits are float32 (bf16 intermediates, a float32 head)."""
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), examples.init_resnet(10, width=8))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 16, 3)), jnp.bfloat16)

    def f(p, x):
        return examples.resnet_apply(p, x).astype(jnp.float32)
    return f, p, x


@pytest.mark.parametrize("case", [_decoder, _cnn], ids=["bf16-decoder", "bf16-cnn"])
def test_every_entry_point_agrees_on_a_low_precision_program(case):
    """freeze=, fold_costly=True, verify=True and fold_params make the same decision on a
    bf16 program with float32 outputs: all fold, none warns or raises, and the checks
    measure the fold in the precision the program computes in."""
    f, p, x = case()
    jaxpr = jax.make_jaxpr(f)(p, x)
    assert jaxpr.out_avals[0].dtype == jnp.float32 and computes_in(jaxpr.jaxpr) == jnp.bfloat16
    ref = np.asarray(jax.jit(f)(p, x))
    counts = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a verify mismatch would warn
        for name, kw in {"freeze": {"freeze": 0}, "fold_costly": {"fold_costly": True},
                         "verify+freeze": {"freeze": 0, "verify": True},
                         "verify+fold_costly": {"fold_costly": True, "verify": True}}.items():
            g = hlofold.fold(f, **kw)
            out = np.asarray(g(p, x))
            rep = g.report(p, x)
            assert rep.running is None, (name, rep.running)
            counts[name] = rep.num_folded
            acc, depth = accumulation_of(jaxpr.jaxpr)
            assert T.mismatch(ref, out, acc, depth, jnp.bfloat16) is None, name
        fp = hlofold.fold_params(f, p, x)
    assert len(set(counts.values())) == 1 and counts["freeze"] > 0, counts
    assert len(fp.changes) == counts["freeze"]


def test_the_fold_of_the_bf16_decoder_is_as_accurate_as_the_original():
    """Against a float32 reference of the same network the folded program errs about as much
    as the bf16 original (issue 40 measured 0.0125 vs 0.0113)."""
    f, p, x = _decoder()
    g = hlofold.fold(f, freeze=0)
    m = g.measure_precision(p, x)
    assert m["max_abs_err_folded"] <= 2 * m["max_abs_err_unfolded"] + 1e-6, m


def test_the_tolerance_reads_the_precision_the_program_computes_in():
    assert T.eps(np.float32) == 2.0 ** -23
    assert T.eps(np.float32, compute=jnp.bfloat16) == 2.0 ** -7
    assert T.eps(np.float32, compute=jnp.float16) == 2.0 ** -10
    assert T.eps(jnp.bfloat16, compute=np.float32) == 2.0 ** -7      # never tighter
    assert T.eps(np.int32, compute=jnp.bfloat16) == 0.0               # non-floats: exact
    assert T.narrowest([np.float32, jnp.bfloat16, np.float16, np.int8]) == jnp.bfloat16
    ref = np.linspace(-3, 3, 1000).astype(np.float32)
    # a bf16-sized rounding passes under bf16 compute, not under float32's
    noisy = ref + np.float32(0.01)
    assert T.mismatch(ref, noisy, 64, 4) is not None
    assert T.mismatch(ref, noisy, 64, 4, compute=jnp.bfloat16) is None
    # a wrong fold (a scale off by 1.5) still fails in bf16, however long the accumulation
    assert T.mismatch(ref, ref * 1.5, 1 << 20, 100, compute=jnp.bfloat16) is not None


def test_the_stablehlo_path_measures_the_same_precision():
    from hlofold._fold.stablehlo.accumulation import module_computes_in
    from hlofold._ir.stablehlo.module import parse_module
    import hlofold._compat as C
    f, p, x = _decoder()
    text = jax.jit(f).lower(p, x).as_text()
    with C.mlir_context():
        assert module_computes_in(parse_module(text)) == jnp.bfloat16
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    leaves = jax.tree.leaves((p, x))
    vrep = hlofold.verify(text, folded, *leaves)
    assert rep.num_folded > 0 and vrep.passed


@pytest.mark.slow
def test_freeze_and_host_prepare_keep_jits_output_sharding():
    """Item 4 (and issue 50 item 9: β sharded otherwise than γ, μ, σ²): parameters sharded
    over both axes of a 4 × 2 mesh; every folded call's output has jax.jit's sharding (24
    combinations of kernel, BatchNorm-vector and input shardings × freeze=/prepare="host"/
    both/default, and a sharded export folded with params= for each kind of vectors). Runs
    in a subprocess (8 host devices)."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "tests.front._output_sharding_script"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ok: 108 folded calls kept jax.jit's output sharding" in proc.stdout
