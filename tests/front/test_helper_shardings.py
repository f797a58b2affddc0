"""A ``@jax.jit(in_shardings=…)`` helper holding the convolution, its BatchNorm in the caller
(issue 68, item 8): inlined to fold, the helper's shardings become constraints — and the
folded kernel ``K'`` is read under the kernel's constraint, as ``K`` was, so the result is
placed as ``jax.jit(f)`` places it (``P('data', None, None, 'model')``, not ``P('data')``).

Runs in a subprocess: 8 host devices must be set before JAX initializes."""
from __future__ import annotations

import textwrap

from tests.helpers import run_on_devices

SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, hlofold
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    S = lambda *s: NamedSharding(mesh, P(*s))

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    helper = jax.jit(conv, in_shardings=(S("data"), S(None, None, None, "model")))

    def f(p, x):
        y = helper(x, p["k"])
        return (y - p["m"]) * p["g"] * lax.rsqrt(p["v"] + 1e-5) + p["b"]
    r = np.random.default_rng(0)
    C = 8
    p = {"k": r.standard_normal((3, 3, C, C)), "g": r.uniform(0.5, 1.5, C),
         "b": r.standard_normal(C), "m": r.standard_normal(C), "v": r.uniform(0.5, 1.5, C)}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    x = r.standard_normal((4, 6, 6, C)).astype(np.float32)
    ref = jax.jit(f)(p, x)
    print("jit", ref.sharding.spec)
    for name, ff in (("fold", hlofold.fold(f)), ("freeze", hlofold.fold(f, freeze=0))):
        out = ff(p, x)
        assert ff.report(p, x).num_folded == 1, ff.report(p, x)
        assert out.sharding.spec == ref.sharding.spec, (name, out.sharding.spec)
        assert float(jnp.max(jnp.abs(out - ref))) < 1e-4
        print("ok", name, out.sharding.spec)
''')


def test_a_helpers_kernel_sharding_is_kept():
    proc = run_on_devices(SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ok fold P('data', None, None, 'model')" in proc.stdout, out[-4000:]
    assert "ok freeze P('data', None, None, 'model')" in proc.stdout, out[-4000:]
