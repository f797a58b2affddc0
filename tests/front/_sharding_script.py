"""Sharded programs on 8 host devices; run by tests/front/test_sharding.py in a subprocess.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX initializes, so
this runs as its own process (``python -m tests._sharding_script [check ...]``); it asserts,
prints one line per check, and exits non-zero on the first failure.

For a ResNet-10 (hlofold.examples) and a conv+BN net with ``with_sharding_constraint``s,
under ``jax.jit(..., in_shardings=..., out_shardings=...)`` on a ``Mesh``, data-parallel
(batch sharded) and with kernels sharded over output channels, ``hlofold.fold`` must

* fold every BN,
* keep the jit's in/out shardings (the compiled folded program's input and output shardings
  equal the unfolded one's; outputs carry the requested sharding),
* keep every ``with_sharding_constraint``,
* match the unfolded results,
* compile to no more all-gathers than the unfolded program (no gather of a whole kernel), for
  the in-graph program (``Folded.lower``) and the steady-state apply part.
"""
from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlofold  # noqa: E402
from hlofold import examples  # noqa: E402

ALL_GATHER = re.compile(r"\ball-gather(?:-start)?\(")


def count_all_gathers(compiled) -> int:
    return len(ALL_GATHER.findall(compiled.as_text()))


def count_constraints(closed) -> int:
    n = 0
    for eqn in closed.jaxpr.eqns:
        n += eqn.primitive.name == "sharding_constraint"
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    n += count_constraints(sub)
    return n


def close(ref, out, rtol=1e-4, atol=1e-5):
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        r, o = np.asarray(r, np.float64), np.asarray(o, np.float64)
        err = float(np.max(np.abs(r - o)))
        bound = rtol * float(np.max(np.abs(r))) + atol
        assert err <= bound, f"max|Δ| = {err:.3g} > {bound:.3g}"


def same_shardings(a, b, what):
    """Two (pytrees of) shardings describe the same placement."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (what, len(la), len(lb))
    for sa, sb in zip(la, lb):
        ndim = len(getattr(sa, "spec", ())) or 4
        assert sa.is_equivalent_to(sb, ndim), f"{what}: {sa} != {sb}"


# --------------------------------------------------------------------------- programs


def kernel_spec(path, leaf, model: bool):
    """Conv kernels (HWIO) sharded over their output channels along 'model'; BN vectors
    along 'model' too; everything else replicated."""
    if not model:
        return P()
    name = jax.tree_util.keystr(path)
    if leaf.ndim == 4 and leaf.shape[-1] % 4 == 0:
        return P(None, None, None, "model")
    if leaf.ndim == 1 and "head" not in name and leaf.shape[0] % 4 == 0:
        return P("model")
    return P()


def constrained_net(params, x, mesh):
    """conv → constraint → BN → relu → conv → BN → constraint → relu → mean."""
    data = NamedSharding(mesh, P("data"))
    y = lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jax.lax.with_sharding_constraint(y, data)
    y = jax.nn.relu(examples._bn(y, params["bn1"]))
    y = lax.conv_general_dilated(y, params["k2"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jax.lax.with_sharding_constraint(examples._bn(y, params["bn2"]), data)
    return jnp.mean(jax.nn.relu(y), axis=(1, 2))


def constrained_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"k1": jnp.asarray(rng.standard_normal((3, 3, 3, 8)) / 5, jnp.float32),
            "bn1": examples._bn_params(rng, 8),
            "k2": jnp.asarray(rng.standard_normal((3, 3, 8, 16)) / 8, jnp.float32),
            "bn2": examples._bn_params(rng, 16)}


def check(name, fun, params, x, mesh, model: bool, n_bn: int, n_constraints: int):
    param_sh = jax.tree_util.tree_map_with_path(
        lambda p, l: NamedSharding(mesh, kernel_spec(p, l, model)), params)
    x_sh = NamedSharding(mesh, P("data"))
    out_sh = NamedSharding(mesh, P("data"))
    jf = jax.jit(fun, in_shardings=(param_sh, x_sh), out_shardings=out_sh)
    params = jax.device_put(params, param_sh)
    x = jax.device_put(x, x_sh)
    ref = jf(params, x)

    ff = hlofold.fold(jf)
    out = ff(params, x)
    rep = ff.report(params, x)
    assert sum(s.pattern == "conv_affine" for s in rep.folded) == n_bn, str(rep)
    close(ref, out)
    same_shardings(out.sharding, out_sh, f"{name}: output sharding")
    assert count_constraints(ff.jaxpr(params, x)) == n_constraints == count_constraints(
        ff.original_jaxpr(params, x)), "with_sharding_constraint lost"

    unfolded = jf.lower(params, x).compile()
    # the folded program as calls run it (prepared kernels and biases as constants, the
    # per-call input as its argument); ``ff.lower_with_arguments`` would add a guard per
    # in-graph site, whose cond makes GSPMD gather model-sharded kernels
    folded = ff.lower(params, x).compile()
    same_shardings(folded.input_shardings[0][-1], unfolded.input_shardings[0][-1],
                   f"{name}: in_sharding of x")
    same_shardings(folded.output_shardings, unfolded.output_shardings,
                   f"{name}: out_shardings")
    g_unf, g_fold = count_all_gathers(unfolded), count_all_gathers(folded)
    assert g_fold <= g_unf, f"{name}: {g_fold} all-gathers folded, {g_unf} unfolded"

    # host (uncommitted) inputs: the jit's in_shardings place them, out_shardings hold
    host = ff(jax.device_get(params), np.asarray(x))
    close(ref, host)
    same_shardings(host.sharding, out_sh, f"{name}: output sharding from host inputs")

    # the steady-state part: prepared (folded) kernels in, conv + bias only
    sp = ff.split(params, x)
    prepared = sp.prepare(params, x)
    close(ref, sp.apply(prepared, params, x))
    apply_c = jax.jit(lambda pr, x: sp.apply(pr, params, x)).lower(prepared, x).compile()
    g_apply = count_all_gathers(apply_c)
    assert g_apply <= g_unf, f"{name}: {g_apply} all-gathers in apply, {g_unf} unfolded"
    same_shardings(apply_c.output_shardings, unfolded.output_shardings,
                   f"{name}: apply out_shardings")

    # frozen parameters: constants, same outputs and output sharding
    fz = hlofold.fold(jf, freeze=0)
    out_fz = fz(params, x)
    close(ref, out_fz)
    same_shardings(out_fz.sharding, out_sh, f"{name}: frozen output sharding")
    print(f"ok {name}: {rep.num_folded} folded, all-gathers unfolded {g_unf} / folded "
          f"{g_fold} / apply {g_apply}", flush=True)


def check_shard_map(kind):
    """``hlofold.fold`` called inside ``jax.shard_map`` (issue 31: it raised "requires varying
    manual axes to match" in 5 of 6 variants): parameters passed or closed over, ``fold``,
    ``freeze=``, ``in_graph=True``, also under an outer ``jax.jit``; each gives ``jax.jit``'s
    results, and the staged shard_map body has no per-channel multiply left after a conv."""
    from jax import shard_map
    from tests.helpers import assert_no_scaling_after_convs
    mesh = jax.make_mesh((8,), ("b",), axis_types=(getattr(jax.sharding.AxisType, kind),))
    rp = jax.device_put(jax.tree.map(jnp.asarray, examples.init_resnet(10, width=8)),
                        NamedSharding(mesh, P()))
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((8, 16, 16, 3)),
                                   jnp.float32), NamedSharding(mesh, P("b")))
    ref = jax.jit(examples.resnet_apply)(rp, x)
    passed = lambda g: shard_map(lambda p, x: g(p, x), mesh=mesh, in_specs=(P(), P("b")),
                                 out_specs=P("b"))
    closed = lambda g: (lambda p, x: shard_map(lambda x: g(rp, x), mesh=mesh,
                                               in_specs=P("b"), out_specs=P("b"))(x))
    ways = {"passed": passed, "jit-passed": lambda g: jax.jit(passed(g))}
    if kind == "Auto":   # JAX closes over Explicit-sharded arrays in shard_map only as args
        ways["closed"] = closed
    for way, wrap in ways.items():
        for name, opts in (("fold", {}), ("freeze", {"freeze": 0}),
                           ("in_graph", {"in_graph": True})):
            g = hlofold.fold(examples.resnet_apply, **opts)
            close(ref, wrap(g)(rp, x))
            body = jax.make_jaxpr(wrap(g))(rp, x)
            inner = [e.params["jaxpr"] for e in body.jaxpr.eqns
                     if e.primitive.name == "shard_map"]
            if way == "closed" or name == "in_graph":
                # parameters known there (closed over), or rescaled in the graph, guarded;
                # passed in, they are traced: left unfolded by default, as under jax.jit
                assert_no_scaling_after_convs(inner[0] if inner else body)
    print(f"ok shard-map-{kind.lower()}: fold, freeze=, in_graph=True inside shard_map "
          f"({', '.join(ways)})", flush=True)


# Explicit mesh axes: with_sharding_constraint is not allowed there (reshard is), and a conv
# with output-channel-sharded kernels needs an explicit out_sharding in the user's code, so
# the explicit mesh runs the data-parallel ResNet only.
CHECKS = ("resnet-data-auto", "resnet-model-auto", "constrained-data-auto",
          "constrained-model-auto", "resnet-data-explicit", "shard-map-auto",
          "shard-map-explicit")


def make_mesh(shape, names, kind):
    """A ``jax.sharding.Mesh`` with Auto axes (GSPMD propagation) or, as ``jax.make_mesh``
    makes by default, Explicit axes (shardings in the types)."""
    if kind == "auto":
        return jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def main(which=CHECKS):
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 16, 16, 3)), jnp.float32)
    rp = examples.init_resnet(10, width=8)
    nbn = examples.count_bn(rp)
    cp = constrained_params()
    for name in which:
        assert name in CHECKS, f"unknown check {name!r}; one of {CHECKS}"
        if name.startswith("shard-map"):
            check_shard_map(name.split("-")[-1].capitalize())
            continue
        net, par, kind = name.split("-")
        mesh = make_mesh((8,), ("data",), kind) if par == "data" else \
            make_mesh((2, 4), ("data", "model"), kind)
        if net == "resnet":
            check(name, examples.resnet_apply, rp, x, mesh, par == "model", nbn, 0)
        else:
            fun = lambda p, x, mesh=mesh: constrained_net(p, x, mesh)
            check(name, fun, cp, x, mesh, par == "model", 2, 2)


if __name__ == "__main__":
    main(*(sys.argv[1:2] and [tuple(sys.argv[1:])]))
