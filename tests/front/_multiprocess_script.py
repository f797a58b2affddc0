"""One process of a two-process ``jax.distributed`` job on this machine (CPU devices, gloo
collectives, 4 devices each: one 8-device mesh), run by ``tests/front/test_multiprocess.py``:

    python -m tests.front._multiprocess_script PROCESS_ID PORT

Parameters and inputs are global arrays no process holds whole (kernels sharded over their
output channels, the batch over the mesh). ``hlofold.fold(f)``, ``freeze=`` and
``hlofold.fold_params`` must give ``jax.jit(f)``'s results there, folding every site that
folds in one process; the prepare step runs on the devices, in the parameters' sharding. So
must a scanned stack of multi-branch blocks (merged and folded per layer), through ``fold``
and through ``fold_stablehlo(params=)`` of its sharded export (the prepared stacks placed in
the shardings the folded export gives them).
Prints one ``ok`` line per check; exits non-zero on the first failure.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlofold  # noqa: E402
from hlofold import examples  # noqa: E402
from hlofold._fold.core import rescale  # noqa: E402


def global_array(value, mesh, spec):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda idx: value[idx])


def spec_of(leaf) -> P:
    """Conv kernels (HWIO) and dense weights over their output features; vectors of 8k
    channels along the mesh; the rest replicated."""
    if leaf.ndim >= 2 and leaf.shape[-1] % 8 == 0:
        return P(*([None] * (leaf.ndim - 1)), "x")
    if leaf.ndim == 1 and leaf.shape[0] % 8 == 0:
        return P("x")
    return P()


def gathered(x) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def close(ref, out, what):
    r, o = gathered(ref), gathered(out)
    err = float(np.max(np.abs(r - o)))
    bound = 1e-4 * float(np.max(np.abs(r))) + 1e-5
    assert err <= bound, f"{what}: max|Δ| = {err:.3g} > {bound:.3g}"


def main(pid: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    host = jax.tree.map(np.asarray, examples.init_resnet(10, width=8, seed=3))
    params = jax.tree.map(lambda a: global_array(a, mesh, spec_of(a)), host)
    x = global_array(np.random.default_rng(0).standard_normal((8, 16, 16, 3)).astype(
        np.float32), mesh, P("x"))
    assert not params["stem"]["conv"].is_fully_addressable
    nbn = examples.count_bn(params)
    ref = jax.jit(examples.resnet_apply)(params, x)

    f = hlofold.fold(examples.resnet_apply)
    close(ref, f(params, x), "fold(f)")
    close(ref, f(params, x), "fold(f), cached")
    rep = f.report(params, x)
    assert rep.num_folded == nbn, str(rep)
    assert all(s.rescale == "prepared" for s in rep.folded), str(rep)
    prog = next(iter(f._programs.values()))
    residuals = prog.cached[3]
    kernels = [r for r in residuals if r.ndim == 4]
    assert kernels and all(not r.is_fully_addressable for r in kernels)   # nothing gathered
    print(f"ok fold: {rep.num_folded} sites folded, prepared on the devices", flush=True)

    fz = hlofold.fold(examples.resnet_apply, freeze=0)
    close(ref, fz(params, x), "freeze=")
    assert fz.report(params, x).num_folded == nbn
    print("ok freeze", flush=True)

    # kernels rescaled on the host by the thread pool in many chunks, in each process
    rescale.PARALLEL_MIN, rescale.CHUNK = 0, 4096
    written = hlofold.fold_params(examples.resnet_apply, params, x)
    single = hlofold.fold_params(examples.resnet_apply, host, np.asarray(gathered(x)))
    assert len(written.changes) == len(single.changes) == nbn + 1, str(written)  # + the head
    for k in ("stem", "stage3_block0"):     # the same values as in one process
        for (pa, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(written.params[k]),
                                   jax.tree_util.tree_leaves_with_path(single.params[k])):
            np.testing.assert_allclose(gathered(a), np.asarray(b), rtol=2e-6, atol=1e-7,
                                       err_msg=jax.tree_util.keystr(pa))
    close(ref, jax.jit(examples.resnet_apply)(written.params, x), "fold_params")
    k0, k1 = params["stem"]["conv"], written.params["stem"]["conv"]
    assert k1.sharding == k0.sharding, (k0.sharding, k1.sharding)
    print(f"ok fold_params: {len(written.changes)} sites written back", flush=True)

    # a scanned stack of RepVGG blocks, its stacks sharded over the channels: each layer's
    # branches merge and its BNs fold, restacked, prepared on the devices
    from tests.fold.jaxpr.test_stacks import branch_stack
    sf, sp, sx = branch_stack()
    sp = jax.tree.map(lambda a: global_array(a, mesh, spec_of(a)), jax.tree.map(np.asarray, sp))
    sx = global_array(np.asarray(sx), mesh, P())
    assert not sp["k3"].is_fully_addressable
    fs = hlofold.fold(sf)
    close(jax.jit(sf)(sp, sx), fs(sp, sx), "fold(f) of a scanned stack")
    srep = fs.report(sp, sx)
    assert [m.layers for m in srep.merged] == [3] and srep.num_folded == 2 and \
        all(s.layers == 3 for s in srep.folded), str(srep)
    print(f"ok stack: {srep.num_folded} sites folded and one merge, per layer", flush=True)

    # the same through the StableHLO path: the sharded export, params= from host values, the
    # prepared stacks placed in the shardings the folded export gives its inputs
    exp = jax.export.export(jax.jit(sf))(sp, sx)
    host_sp = jax.tree.map(gathered, sp)
    new, hrep, prepared = hlofold.fold_stablehlo(exp, params={
        f"arg{i}": v for i, v in enumerate(jax.tree.leaves(host_sp))})
    assert [m.layers for m in hrep.merged] == [3] and hrep.num_folded == 2, str(hrep)
    shardings = new.in_shardings_jax(mesh)
    placed = [jax.device_put(np.asarray(v), s) for v, s in zip(prepared, shardings[1:])]
    assert placed and not any(a.is_fully_addressable for a in placed), shardings
    close(jax.jit(sf)(sp, sx), jax.jit(new.call)(sx, *placed), "fold_stablehlo(params=)")
    print("ok stack hlo: per layer, run sharded", flush=True)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
