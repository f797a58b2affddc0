"""Output shardings of ``freeze=`` and ``prepare="host"`` against ``jax.jit``'s (issue 40,
item 4), on 8 host devices: run by ``tests/front/test_precision_rule.py`` in a subprocess.

A conv → BatchNorm net whose kernel and BatchNorm vectors are sharded over both mesh axes
(Auto axes: the output's sharding is what the compiler propagates). Before the fix, the
folded bias (``(1, 1, 1, C)``, a shape no parameter has) was replicated, and the output came
back ``P('data')`` where ``jax.jit`` gives ``P('data', None, None, 'model')``. Prints one
``ok`` line, or the mismatches and exits 1.
"""
from __future__ import annotations

import itertools
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlofold  # noqa: E402
from tests.helpers.conv_bn import conv_bn, conv_bn_params  # noqa: E402


def net(p, x):
    return jax.nn.relu(conv_bn(p, x))


def main() -> int:
    assert len(jax.devices()) == 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    c = 8
    p0 = conv_bn_params(rng, c)
    x0 = jnp.asarray(rng.normal(size=(8, 8, 8, c)), jnp.float32)
    kernels = [P(None, None, None, "model"), P(None, None, "model", "data"),
               P(None, None, None, ("data", "model"))]
    # (γ, μ, σ²'s sharding; β's): issue 50 item 9 shards β differently from the others
    vectors = [(P("model"), P("model")), (P(("data", "model")), P(("data", "model"))),
               (P("model"), P()), (P(), P("model"))]
    inputs = [P("data"), P(None, None, None, "model")]
    bad, n = [], 0
    for k, (v, vb), xs in itertools.product(kernels, vectors, inputs):
        vec = NamedSharding(mesh, v)
        p = jax.device_put(p0, {"k": NamedSharding(mesh, k), "mean": vec, "var": vec,
                                "gamma": vec, "beta": NamedSharding(mesh, vb)})
        x = jax.device_put(x0, NamedSharding(mesh, xs))
        ref = jax.jit(net)(p, x)
        for kw in ({"freeze": 0}, {"prepare": "host"}, {"freeze": 0, "prepare": "host"}, {}):
            y = hlofold.fold(net, **kw)(p, x)
            n += 1
            err = float(jnp.max(jnp.abs(y - ref)))
            if not y.sharding.is_equivalent_to(ref.sharding, 4) or err > 1e-4:
                bad.append(f"kernel {k}, vectors {v} (beta {vb}), x {xs}, {kw}: {y.sharding.spec} "
                           f"vs jax.jit's {ref.sharding.spec}, max|Δ| {err:.2g}")
    # a sharded export, params= (issue 50 item 9; issue 68 item 9: the kernel replicated or
    # sharded on its input channels, the vectors mixed)
    for k, (v, vb) in itertools.product(
            [kernels[0], P(), P(None, None, "model", None)], vectors):
        vec = NamedSharding(mesh, v)
        p = jax.device_put(p0, {"k": NamedSharding(mesh, k), "mean": vec, "var": vec,
                                "gamma": vec, "beta": NamedSharding(mesh, vb)})
        x = jax.device_put(x0, NamedSharding(mesh, inputs[0]))
        ref = jax.jit(net)(p, x)
        n += 1
        pin = jax.tree.map(lambda a: a.sharding, p)
        exp = jax.export.export(jax.jit(net, in_shardings=(pin, x.sharding)))(p, x)
        new, rep, prepared = hlofold.fold_stablehlo(exp, params={
            i: np.asarray(a) for i, a in enumerate(jax.tree.leaves(p))})
        shs = new.in_shardings_jax(mesh)
        y = new.call(jax.device_put(x, shs[0]),
                     *[jax.device_put(v, s) for v, s in zip(prepared, shs[1:])])
        err = float(jnp.max(jnp.abs(y - ref)))
        if not y.sharding.is_equivalent_to(ref.sharding, 4) or err > 1e-4:
            bad.append(f"export params=, kernel {k}, vectors {v} (beta {vb}): "
                       f"{y.sharding.spec} vs "
                       f"jax.jit's {ref.sharding.spec}, max|Δ| {err:.2g}")
    if bad:
        print("\n".join(bad))
        return 1
    print(f"ok: {n} folded calls kept jax.jit's output sharding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
