"""``hlofold.fold(jax.jit(f, compiler_options=...))``: a jit's compiler options hold only at
the top level, and hlofold traced the jitted function inside its own trace — so it raised
``ValueError: compiler_options can only be passed to top-level jax.jit`` where ``jax.jit``
ran (found while choosing XLA:CPU's YNNPACK fusion per program for RepVGG, issue 38). Now the
function is traced and every program hlofold compiles for it takes the options: the folded
apply program, the original (fallbacks), verify's reference, the device-prepared apply, and
the program run where nothing folds. An option value XLA rejects is rejected the same way
(which shows the options reach each compile)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import max_err
from tests.helpers.conv_bn import conv_bn, conv_bn_params

GOOD = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_embed_ir_in_executable": True}
BAD = {"xla_cpu_experimental_ynn_fusion_type": "bogus"}
WAYS = {
    "host prepare": dict(),
    "device prepare": dict(prepare="device"),
    "verify": dict(verify=True),
    "frozen": dict(freeze=0),
}


def _model():
    p = conv_bn_params(np.random.default_rng(0), c=4)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 6, 4)), jnp.float32)
    return p, x


@pytest.mark.parametrize("way", WAYS)
def test_a_jit_with_compiler_options_folds_and_keeps_them(way):
    p, x = _model()
    f = jax.jit(conv_bn, compiler_options=GOOD)
    g = hlofold.fold(f, **WAYS[way])
    out = g(p, x)
    assert max_err(f(p, x), out) <= 1e-5
    assert g.report(p, x).num_folded == 1
    assert max_err(f(p, x), g(p, x)) <= 1e-5          # the steady path
    # the options reach the compile: a value XLA rejects fails as it does under jax.jit
    bad = jax.jit(conv_bn, compiler_options=BAD)
    with pytest.raises(Exception, match="bogus") as under_jit:
        bad(p, x)
    with pytest.raises(type(under_jit.value), match="bogus"):
        hlofold.fold(bad, **WAYS[way])(p, x)


def test_nothing_to_fold_runs_with_the_options():
    x = jnp.ones((3, 4))
    f = jax.jit(lambda x: jnp.tanh(x) * 2.0, compiler_options=GOOD)
    assert max_err(f(x), hlofold.fold(f)(x)) == 0.0
    with pytest.raises(Exception, match="bogus"):
        hlofold.fold(jax.jit(lambda x: jnp.tanh(x) * 2.0, compiler_options=BAD))(x)


def test_static_arguments_and_fold_params_with_options():
    p, x = _model()

    def f(p, x, relu):
        y = conv_bn(p, x)
        return jax.nn.relu(y) if relu else y
    jf = jax.jit(f, static_argnums=2, compiler_options=GOOD)
    g = hlofold.fold(jf)
    for relu in (True, False):
        assert max_err(jf(p, x, relu), g(p, x, relu)) <= 1e-5
        assert g.report(p, x, relu).num_folded == 1
    jc = jax.jit(conv_bn, compiler_options=GOOD)
    res = hlofold.fold_params(jc, p, x)
    assert len(res.changes) == 1
    assert max_err(jc(p, x), jc(res.params, x)) <= 1e-5
