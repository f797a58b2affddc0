"""Sharded StableHLO (Shardy) through every StableHLO path, on 8 host devices (issue 40).

``python -m tests.fold.stablehlo._shardy_script CHECK ...`` (``XLA_FLAGS`` must give 8 devices
before JAX starts: ``tests/fold/stablehlo/test_shardy.py`` runs it in a subprocess). For a conv →
BatchNorm net (kernels sharded over output channels, data over the batch) and a two-layer
decoder (RMSNorm → q/k/v, gate/up; kernels sharded over their output features), the decoder
as one scan over stacked layers (each stack sharded over its last axis), lowered with
``jax.jit(..., in_shardings=..., out_shardings=...)``: in the graph, ``params=``, ``split=``, a
sharded ``jax.export`` with ``params=``, and the CLI, each folded module keeps ``sdy.mesh``,
gives prepared weights their origin's sharding, compiles and runs sharded with the original's
outputs and output sharding. Prints ``ok CHECK: ...`` per check.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlofold  # noqa: E402
from hlofold import examples  # noqa: E402
from hlofold._ir.stablehlo.artifacts import module_callable  # noqa: E402
from tests.helpers.conv_bn import conv, conv_bn, conv_bn_params  # noqa: E402


def conv_net(p, x):
    y = jax.lax.with_sharding_constraint(jax.nn.relu(conv_bn(p, x)),
                                         NamedSharding(MESH, P("data")))
    return conv(y, p["k2"])


def conv_case(mesh):
    rng = np.random.default_rng(0)
    c = 8
    p = conv_bn_params(rng, c, k2=(1, 1, c, c))
    x = jnp.asarray(rng.normal(size=(8, 8, 8, c)), jnp.float32)
    vec = NamedSharding(mesh, P("model"))
    shard = {"k": NamedSharding(mesh, P(None, None, None, "model")), "mean": vec, "var": vec,
             "gamma": vec, "beta": vec, "k2": NamedSharding(mesh, P())}
    return conv_net, p, x, shard, NamedSharding(mesh, P("data")), \
        NamedSharding(mesh, P("data", None, None, "model")), 1


def decoder_case(mesh):
    p = examples.init_decoder(2, d=64)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 16)), jnp.int32)

    def spec(path, leaf):
        return NamedSharding(mesh, P(None, "model") if leaf.ndim == 2 else P())
    shard = jax.tree_util.tree_map_with_path(spec, p)
    return examples.decoder_apply, p, tokens, shard, NamedSharding(mesh, P("data")), \
        NamedSharding(mesh, P("data")), 4


def stack_case(mesh):
    """The decoder as one scan over stacked layers (MaxText layout), each stacked leaf
    sharded over its last axis: the while's stacks fold per layer (issue 39)."""
    p = examples.stack_decoder(examples.init_decoder(2, d=64))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 16)), jnp.int32)

    def spec(path, leaf):
        return NamedSharding(mesh, P(*([None] * (leaf.ndim - 1)), "model")
                             if leaf.ndim >= 3 and leaf.shape[-1] % 2 == 0 else P())
    shard = jax.tree_util.tree_map_with_path(spec, p)
    return examples.scanned_decoder_apply, p, tokens, shard, NamedSharding(mesh, P("data")), \
        NamedSharding(mesh, P("data")), 1


def residual_case(mesh):
    """Residual stages (two streams: :mod:`tests.helpers.residual_programs`), kernels sharded
    over their output channels: folded on every path, then equalized (``params=,
    equalize=True``) with its streams, kept sharded."""
    from tests.helpers.residual_programs import program
    fn, p, x, _, _ = program(1)

    def spec(path, leaf):
        return NamedSharding(mesh, P(None, None, None, "model") if leaf.ndim == 4 else P())
    return fn, p, jnp.tile(x, (4, 1, 1, 1)), jax.tree_util.tree_map_with_path(spec, p), \
        NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")), 4


def close(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    err = float(np.max(np.abs(a - b)))
    assert err <= 1e-4 * max(1.0, float(np.max(np.abs(a)))), (what, err)
    return err


def same_sharding(a, b, what):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (what, a.sharding, b.sharding)


MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def run_check(name: str) -> str:
    mesh = MESH
    fn, p, x, p_shard, x_shard, out_shard, n_min = {
        "conv": conv_case, "decoder": decoder_case, "stack": stack_case,
        "residual": residual_case}[name](mesh)
    jitted = jax.jit(fn, in_shardings=(p_shard, x_shard), out_shardings=out_shard)
    p = jax.device_put(p, p_shard)
    x = jax.device_put(x, x_shard)
    ref = jitted(p, x)
    text = jitted.lower(p, x).as_text()
    assert "sdy.mesh" in text
    leaves = jax.tree.leaves(p)
    in_sh = list(jax.tree.leaves(p_shard)) + [x_shard]
    n_w = len(leaves)

    # in the graph: the same arguments, the same shardings
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded >= n_min and "sdy.mesh" in folded, rep
    out = module_callable(folded, "cpu", in_sh, [out_shard])(*leaves, x)[0]
    close(ref, out, "in the graph")
    same_sharding(out, ref, "in the graph")

    # params=: the weights bound and folded once; prepared weights keep their origin's sharding
    apply, rep, prepared = hlofold.fold_stablehlo(
        text, params={i: np.asarray(v) for i, v in enumerate(leaves)})
    assert rep.num_folded >= n_min and "sdy.mesh" in apply, rep
    main = [l for l in apply.splitlines() if "func.func public @main" in l][0]
    assert main.count("sdy.sharding") >= 2 + len(prepared) // 2, main
    from hlofold._ir.stablehlo.artifacts import input_specs
    n_prep = len(input_specs(apply)) - 1
    prep_sh = [_sharding_of(main, 1 + j, mesh) for j in range(n_prep)]
    out = module_callable(apply, "cpu", [x_shard] + prep_sh, [out_shard])(
        x, *[jax.device_put(v, s) for v, s in zip(prepared, prep_sh)])[0]
    close(ref, out, "params=")
    same_sharding(out, ref, "params=")

    # split=: prepare runs sharded, its results in their origin's sharding, then apply
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=[f"arg{n_w}"])
    assert rep.num_folded >= n_min and "sdy.mesh" in prepare and "sdy.mesh" in apply
    amain = [l for l in apply.splitlines() if "func.func public @main" in l][0]
    k = len(input_specs(apply)) - 1
    a_sh = [_sharding_of(amain, 1 + j, mesh) for j in range(k)]
    got = module_callable(prepare, "cpu", in_sh[:-1], a_sh + [NamedSharding(mesh, P())])(
        *leaves)
    assert bool(got[-1])
    for v, s in zip(got[:-1], a_sh):
        assert v.sharding.is_equivalent_to(s, v.ndim), (v.sharding, s)
    out = module_callable(apply, "cpu", [x_shard] + a_sh, [out_shard])(x, *got[:-1])[0]
    close(ref, out, "split=")
    same_sharding(out, ref, "split=")

    # a sharded jax.export: in the graph, the same inputs; params= gives an Exported whose
    # new inputs keep the shardings
    exp = jax.export.export(jitted)(p, x)
    new, rep = hlofold.fold_stablehlo(exp, in_graph=True)
    assert rep.num_folded >= n_min
    out = jax.jit(new.call)(p, x)
    close(ref, out, "export in the graph")
    same_sharding(out, ref, "export in the graph")
    new, rep, prepared = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(v) for i, v in enumerate(leaves)})
    assert rep.num_folded >= n_min
    import hlofold._compat as C
    new_sh = C.exported_input_shardings(new)[1:]
    assert all(s is not None for s in new_sh), new_sh
    placed = [jax.device_put(v, NamedSharding(mesh, s.spec)) for v, s in zip(prepared, new_sh)]
    out = jax.jit(new.call)(x, *placed)
    close(ref, out, "export params=")
    same_sharding(out, ref, "export params=")
    if name in ("decoder", "stack"):    # smooth=: calibrated in this process, kept sharded
        calib = [[np.asarray(x)], [np.asarray((x + 7) % 256)]]
        for alpha in (0.5, "search:w4a8"):      # (α searched: each pair's, or each layer's)
            new, srep, prepared = hlofold.fold_stablehlo(
                exp, params={i: np.asarray(v) for i, v in enumerate(leaves)}, smooth=calib,
                alpha=alpha)
            assert len(srep.smoothed) >= 5, srep
            assert all((e.searched is None) == (alpha == 0.5) for e in srep.smoothed), srep
            new_sh = C.exported_input_shardings(new)[1:]
            placed = [jax.device_put(v, NamedSharding(mesh, s.spec if s is not None else P()))
                      for v, s in zip(prepared, new_sh)]
            out = jax.jit(new.call)(x, *placed)
            close(ref, out, f"export smooth= alpha={alpha}")
        smoothed = f", {len(srep.smoothed)} pairs smoothed"
    elif name == "residual":        # equalize=: the streams walked in the sharded module
        new, erep, prepared = hlofold.fold_stablehlo(
            exp, params={i: np.asarray(v) for i, v in enumerate(leaves)}, equalize=True)
        got = (len(erep.equalized), sum(bool(e.writers) for e in erep.equalized))
        assert got == (4, 2), erep
        new_sh = C.exported_input_shardings(new)[1:]
        placed = [jax.device_put(v, NamedSharding(mesh, s.spec if s is not None else P()))
                  for v, s in zip(prepared, new_sh)]
        out = jax.jit(new.call)(x, *placed)
        close(ref, out, "export equalize=")
        same_sharding(out, ref, "export equalize=")
        smoothed = f", {got[0]} pairs equalized ({got[1]} streams)"
    else:
        smoothed = ""

    # the CLI
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "m.mlir"), os.path.join(d, "o.mlir")
        with open(src, "w") as f:
            f.write(text)
        proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", src, "-o", dst,
                               "--in-graph"], capture_output=True, text=True)
        assert proc.returncode == 0 and os.path.exists(dst), proc.stderr[-2000:]
    return f"{rep.num_folded} folded{smoothed}"


def run_manual() -> str:
    """A conv → BatchNorm inside ``shard_map`` (``sdy.manual_computation``): folds in the graph
    and with ``params=``, and runs sharded with the original's outputs."""
    mesh = MESH
    fn, p, x, _, x_shard, _, _ = conv_case(mesh)
    p.pop("k2")

    inner = conv_bn
    rep_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), p)
    jitted = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")),
                                   out_specs=P("data")),
                     in_shardings=(rep_sh, x_shard), out_shardings=x_shard)
    p, x = jax.device_put(p, rep_sh), jax.device_put(x, x_shard)
    ref = jitted(p, x)
    text = jitted.lower(p, x).as_text()
    assert "sdy.manual_computation" in text
    leaves = jax.tree.leaves(p)
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == 1, rep
    out = module_callable(folded, "cpu", list(jax.tree.leaves(rep_sh)) + [x_shard],
                          [x_shard])(*leaves, x)[0]
    close(ref, out, "manual, in the graph")
    same_sharding(out, ref, "manual, in the graph")
    apply, rep, prepared = hlofold.fold_stablehlo(
        text, params={i: np.asarray(v) for i, v in enumerate(leaves)})
    assert rep.num_folded == 1, rep
    rep_1 = NamedSharding(mesh, P())
    out = module_callable(apply, "cpu", [x_shard] + [rep_1] * len(prepared), [x_shard])(
        x, *[jax.device_put(v, rep_1) for v in prepared])[0]
    close(ref, out, "manual, params=")
    return "1 folded inside sdy.manual_computation"


def _sharding_of(main_line: str, arg: int, mesh):
    """The NamedSharding ``%arg{arg}``'s ``sdy.sharding`` says (replicated where none)."""
    import re
    m = re.search(rf"%arg{arg}: tensor<[^>]*>( \{{sdy.sharding = #sdy.sharding<@mesh, "
                  rf"\[([^\]]*)\]>)?", main_line)
    dims = re.findall(r"\{([^}]*)\}", m.group(2)) if m and m.group(2) else []
    spec = [tuple(a.strip().strip('"') for a in d.split(",")) if d.strip() else None
            for d in dims]
    spec = [s[0] if s and len(s) == 1 else s for s in spec]
    return NamedSharding(mesh, P(*spec))


CHECKS = ("conv", "decoder", "manual", "stack", "residual")

if __name__ == "__main__":
    for name in sys.argv[1:] or CHECKS:
        if name not in CHECKS:
            sys.exit(f"unknown check {name}")
        print(f"ok {name}: {run_manual() if name == 'manual' else run_check(name)}",
              flush=True)
