"""A scanned stack whose body constrains its activations on a Shardy mesh (MaxText's
``scan_layers=True`` export; issue 69, item 2): ``fold_stablehlo(params=)`` folds it layer by
layer — each layer's module carries the ``sdy.mesh`` the constraints name (it had raised
"unknown mesh: @mesh") — and the folded module keeps the mesh and the constraints.

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

    def f(p, x):
        def body(h, w):
            y = h @ w["k"]
            y = (y - w["m"]) * w["g"] * lax.rsqrt(w["v"] + 1e-5) + w["b"]
            return lax.with_sharding_constraint(jax.nn.relu(y), S("data", None)), None
        return lax.scan(body, x, p)[0]
    L, C = 3, 8
    r = np.random.default_rng(0)
    p = {"k": r.standard_normal((L, C, C)), "g": r.uniform(0.5, 1.5, (L, C)),
         "b": r.standard_normal((L, C)), "m": r.standard_normal((L, C)),
         "v": r.uniform(0.5, 1.5, (L, C))}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    x = r.standard_normal((4, C)).astype(np.float32)
    exp = jax.export.export(jax.jit(f))(p, x)
    bound = {f"arg{i}": v for i, v in enumerate(jax.tree.leaves(p))}
    new, rep, prep = hlofold.fold_stablehlo(exp, params=bound)
    assert rep.num_folded == 1 and rep.folded[0].layers == L, rep
    text = new.mlir_module()
    assert "sdy.mesh @mesh" in text and "sdy.sharding_constraint" in text
    rep8 = S()
    y = jax.jit(new.call, in_shardings=(rep8,) * (1 + len(prep)))(x, *prep)
    err = float(jnp.max(jnp.abs(y - jax.jit(f)(p, x))))
    assert err < 1e-4, err
    print("ok scanned shardy", err)
''')


def test_a_scanned_stack_with_shardy_constraints_folds_per_layer():
    proc = run_on_devices(SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ok scanned shardy" in proc.stdout, out[-4000:]
