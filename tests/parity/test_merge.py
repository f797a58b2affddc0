"""Parallel branches merged into one convolution, on both paths (issue 38).

Flax RepVGG, MobileOne, ACNet and DBB networks (``benchmarks/repmodels.py``, written from
the papers) run with their deploy form's convolution count under every jaxpr entry point
(``fold``, ``freeze=``, ``fold_jaxpr`` with known or prepared weights, ``lower``/``export``)
and on StableHLO (constants in the graph, ``params=``, the CLI), outputs equal within
hlofold's tolerance model; timm's train-time RepVGG-A0, MobileOne-S0 and RepViT-M0.9,
exported by PyTorch/XLA, fold to timm's own ``reparameterize_model`` count. Each refusal is asserted on
both paths with its reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold import _compat as C
from hlofold._base.reasons import reason_kind
from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
from tests.helpers import DATA, assert_close
from tests.helpers.torch_weights import weight

repmodels = pytest.importorskip("benchmarks.repmodels")

KINDS = ("repvgg", "mobileone", "acnet", "dbb")


def convs_in(text: str) -> int:
    return text.count("stablehlo.convolution")


def branch_records(report, status=None):
    return [s for s in report.sites if s.pattern == "branches"
            and (status is None or s.status == status)]


@pytest.fixture(scope="module", params=KINDS)
def net(request):
    apply, v, x = repmodels.make(request.param, width=16, blocks=4, size=16)
    return request.param, apply, v, x, jax.jit(apply)(v, x)


@pytest.mark.slow
def test_every_jaxpr_entry_point_runs_the_deploy_form(net):
    kind, apply, v, x, ref = net
    want = repmodels.deploy_convs(kind, 4)
    blocks = 8 if kind == "mobileone" else 4
    for f in (hlofold.fold(apply), hlofold.fold(apply, freeze=0),
              hlofold.fold(apply, prepare="device")):
        assert_close(ref, f(v, x), depth=12)
        rep = f.report(v, x)
        assert len(rep.merged) == blocks and not branch_records(rep, "refused"), rep
        assert repmodels.conv_count(f.jaxpr(v, x)) == want
        assert not [s for s in rep.sites if s.status == "not-reached"], rep
    closed = jax.make_jaxpr(apply)(v, x)
    for mode in ("prepared", "unguarded"):
        folded, rep = hlofold.fold_jaxpr(closed, in_graph=mode)
        assert repmodels.conv_count(folded) == want and len(rep.merged) == blocks
        assert_close(ref, C.jaxpr_as_fun(folded)(*jax.tree.leaves(v), x)[0], depth=12)
    text = hlofold.lower(hlofold.fold(apply), v, x, freeze=0)
    assert convs_in(text) == want
    exp = hlofold.export(hlofold.fold(apply), v, x, freeze=0)
    assert convs_in(exp.mlir_module()) == want
    assert_close(ref, exp.call(x), depth=12)


def test_merge_records_say_what_merged_and_where(net):
    kind, apply, v, x, _ = net
    rep = hlofold.fold(apply, freeze=0).report(v, x)
    for s in rep.merged:
        assert s.file and s.file.endswith("repmodels.py") and s.line, s
        assert len(s.absorbed) >= 2 and "branches -> one" in s.note
        assert s.rescale == "constant"
    if kind == "repvgg":
        assert ["3×3 conv", "1×1 conv", "identity"] in [s.absorbed for s in rep.merged]
    if kind == "dbb":
        assert all("1×1→3×3 avg pool" in s.absorbed and "1×1→3×3 conv" in s.absorbed
                   for s in rep.merged)
    assert "branch sums merged" in str(rep)


@pytest.mark.slow
def test_merge_false_keeps_the_branches_on_every_path(net, tmp_path):
    """``merge=False`` (``fold``, ``fold_jaxpr``, ``fold_stablehlo``, ``--no-merge``): each
    branch's BN folds, no branch merges, the train-time convolutions stay."""
    kind, apply, v, x, ref = net
    train = repmodels.conv_count(jax.make_jaxpr(apply)(v, x))
    f = hlofold.fold(apply, merge=False)
    assert_close(ref, f(v, x), depth=12)
    rep = f.report(v, x)
    assert not branch_records(rep) and rep.num_folded > 0
    assert repmodels.conv_count(f.jaxpr(v, x)) == train
    _, rep = hlofold.fold_jaxpr(jax.make_jaxpr(apply)(v, x), in_graph="prepared",
                                merge=False)
    assert not branch_records(rep) and rep.num_folded > 0
    exp = jax.export.export(jax.jit(lambda x: apply(v, x)))(x)
    got, srep = hlofold.fold_stablehlo(exp, merge=False)
    assert not branch_records(srep) and convs_in(got.mlir_module()) == train
    assert_close(ref, got.call(x), depth=12)
    if kind == "repvgg":
        src, out = tmp_path / "m.mlir", tmp_path / "o.mlir"
        src.write_text(exp.mlir_module())
        proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o",
                               str(out), "--no-merge"], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr
        assert convs_in(out.read_text()) == train and "merged" not in proc.stdout


def test_guarded_in_graph_fold_says_why_branches_stay(net):
    kind, apply, v, x, ref = net
    folded, rep = hlofold.fold_jaxpr(jax.make_jaxpr(apply)(v, x))      # guarded
    assert not rep.merged
    recs = branch_records(rep, "refused")
    assert recs and {reason_kind(s.reason) for s in recs} == {"weights-not-known"}
    assert "in_graph='prepared'" in recs[0].reason
    assert_close(ref, C.jaxpr_as_fun(folded)(*jax.tree.leaves(v), x)[0], depth=12)


def test_stablehlo_merges_with_constants_and_with_params(net):
    kind, apply, v, x, ref = net
    want = repmodels.deploy_convs(kind, 4)
    blocks = 8 if kind == "mobileone" else 4
    exp = jax.export.export(jax.jit(lambda x: apply(v, x)))(x)
    folded, rep = hlofold.fold_stablehlo(exp)
    assert len(rep.merged) == blocks and convs_in(folded.mlir_module()) == want
    assert_close(ref, folded.call(x), depth=12)
    leaves, tree = jax.tree.flatten(v)
    args = jax.export.export(jax.jit(lambda *a: apply(jax.tree.unflatten(tree, a[:-1]),
                                                      a[-1])))(*leaves, x)
    got, rep2, prepared = hlofold.fold_stablehlo(
        args, params={i: np.asarray(a) for i, a in enumerate(leaves)})
    assert len(rep2.merged) == blocks and convs_in(got.mlir_module()) == want
    assert_close(ref, got.call(x, *prepared), depth=12)
    # weights as arguments, folded in the graph (guarded): the branches stay, with why
    same, rep3 = hlofold.fold_stablehlo(args, in_graph=True)
    assert not rep3.merged and {reason_kind(s.reason) for s in branch_records(rep3)} == \
        {"weights-not-known"}
    assert_close(ref, same.call(*leaves, x), depth=12)


def test_stablehlo_split_merges_in_the_prepare_module(net):
    """``split=``: the merged kernel and bias are computed by the prepare module from the
    weights (unguarded, checked by its ``ok``); apply runs the deploy form. A 1×1 → k×k pair
    is composed on the host only, so under split= DBB's pairs stay branches (with the
    reason) and the rest of each block merges."""
    kind, apply, v, x, ref = net
    leaves, tree = jax.tree.flatten(v)
    exp = jax.export.export(jax.jit(lambda *a: apply(jax.tree.unflatten(tree, a[:-1]),
                                                     a[-1])))(*leaves, x)
    app, rep, prep = hlofold.fold_stablehlo(exp.mlir_module(), split=[f"arg{len(leaves)}"])
    *made, ok = module_callable(prep)(*leaves)
    assert bool(ok)
    assert_close(ref, module_callable(app)(x, *made)[0], depth=12)
    blocks = 8 if kind == "mobileone" else 4
    assert len(rep.merged) == blocks and all(s.rescale == "in-graph" for s in rep.merged)
    want = repmodels.deploy_convs(kind, 4) + (12 if kind == "dbb" else 0)
    assert convs_in(str(app)) == want
    if kind == "dbb":
        assert all("1×1→k×k pair left: a sequential 1×1 → k×k pair is composed on the host "
                   "only" in s.note for s in rep.merged), [s.note for s in rep.merged]


@pytest.mark.parametrize("arch", ["repvgg_a0", pytest.param("mobileone_s0", marks=pytest.mark.slow),
                                  pytest.param("repvit_m0_9", marks=pytest.mark.slow)])
def test_timm_train_time_modules_fold_to_timms_deploy_form(arch):
    text = open(os.path.join(DATA, f"{arch}_torch_xla.mlir")).read()
    meta = json.load(open(os.path.join(DATA, f"{arch}_torch_xla.json")))
    names = meta["args"]
    weights = {f"arg{i}": weight(n, sp.shape)
               for i, (n, sp) in enumerate(zip(names, input_specs(text))) if n != "input"}
    io = np.load(os.path.join(DATA, f"{arch}_torch_xla_io.npz"))
    full = [weights[f"arg{i}"] if n != "input" else io["x"] for i, n in enumerate(names)]
    ref = module_callable(text)(*full)[0]
    assert_close(io["y"], ref, depth=40)              # the module computes what PyTorch did
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=weights)
    assert convs_in(str(apply)) <= meta["deploy_convs"] < convs_in(text)
    assert "batch_norm_inference" not in str(apply) and "rsqrt" not in str(apply)
    assert not [s for s in rep.sites if s.status == "not-reached"], rep.counts()
    if arch == "repvit_m0_9":      # 23 token mixers merge (their BatchNorm after the sum
        assert len(rep.merged) == 23, rep.counts()  # too); the other convs are not branches
    else:                          # (before: 126 -> 103 convs, one BatchNorm left)
        assert rep.num_refused == 0 and len(rep.merged) == meta["deploy_convs"], rep.counts()
    assert_close(ref, module_callable(apply)(io["x"], *prepared)[0], depth=40)


def test_cli_merges_with_params(tmp_path):
    apply, v, x = repmodels.make("repvgg", width=8, blocks=3, size=8)
    leaves, tree = jax.tree.flatten(v)
    exp = jax.export.export(jax.jit(lambda *a: apply(jax.tree.unflatten(tree, a[:-1]),
                                                     a[-1])))(*leaves, x)
    src = tmp_path / "rep.mlir"
    src.write_text(exp.mlir_module())
    np.savez(tmp_path / "w.npz", **{f"arg{i}": np.asarray(a) for i, a in enumerate(leaves)})
    out = tmp_path / "out.mlir"
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                           "--params", str(tmp_path / "w.npz"), "--prepared-out",
                           str(tmp_path / "p.npz")], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert convs_in(out.read_text()) == 3 and "3 branch sums merged" in proc.stdout, proc.stdout
    prepared = np.load(tmp_path / "p.npz")
    got = module_callable(out.read_text())(x, *[prepared[k] for k in prepared.files])[0]
    assert_close(jax.jit(apply)(v, x), got, depth=6)


# ---------------------------------------------------------------- refusals, both paths

RNG = np.random.default_rng(3)
CH = 8
K3 = jnp.asarray(RNG.standard_normal((3, 3, CH, CH)) * 0.2, jnp.float32)
K1 = jnp.asarray(RNG.standard_normal((1, 1, CH, CH)) * 0.2, jnp.float32)
KG = jnp.asarray(RNG.standard_normal((3, 3, CH // 2, CH)) * 0.2, jnp.float32)
X = jnp.asarray(RNG.standard_normal((2, 8, 8, CH)), jnp.float32)


def _bn():
    return [jnp.asarray(a, jnp.float32) for a in (RNG.standard_normal(CH) * 0.2,
                                                  RNG.uniform(0.5, 1.5, CH),
                                                  RNG.standard_normal(CH) * 0.2,
                                                  RNG.uniform(0.5, 1.5, CH))]


B1, B2, B3 = _bn(), _bn(), _bn()


def conv(x, k, st=1, pad=1, g=1, rd=1):
    pad = [(pad, pad)] * 2 if isinstance(pad, int) else pad
    return lax.conv_general_dilated(x, k, (st, st), pad, rhs_dilation=(rd, rd),
                                    feature_group_count=g,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def bn(y, p):
    return (y - p[0]) * (p[3] * lax.rsqrt(p[1] + 1e-5)) + p[2]


REFUSALS = {
    "strides differ": lambda x: bn(conv(x, K3, st=2), B1) + bn(conv(x, K1, pad=-2), B2),
    "windows do not align": lambda x: bn(conv(x, K3), B1) +
    bn(conv(x, K3[1:2], pad=[(0, 0), (2, 0)]), B2),
    "dilations differ": lambda x: bn(conv(x, K3, pad=2, rd=2), B1) + bn(conv(x, K3), B2),
    "groups differ": lambda x: bn(conv(x, KG, g=2), B1) + bn(conv(x, K1, pad=0), B2),
    "a nonlinearity on a branch": lambda x: jnp.tanh(bn(conv(x, K3), B1)) +
    bn(conv(x, K1, pad=0), B2),
    "read elsewhere too": lambda x: (lambda a: (a + bn(conv(x, K1, pad=0), B2), a))(
        bn(conv(x, K3), B1)),
}


@pytest.mark.parametrize("why", sorted(REFUSALS))
def test_refusals_on_both_paths(why):
    f = REFUSALS[why]
    ref = f(X)
    folded, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    recs = branch_records(rep)
    assert [s.status for s in recs] == ["refused"] and why in recs[0].reason, rep
    assert not rep.merged
    assert_close(ref, C.jaxpr_as_fun(folded)(X) if isinstance(ref, tuple) else
                 C.jaxpr_as_fun(folded)(X)[0])
    exp = jax.export.export(jax.jit(f))(X)
    got, srep = hlofold.fold_stablehlo(exp)
    recs = branch_records(srep)
    assert [s.status for s in recs] == ["refused"] and why in recs[0].reason, srep
    assert reason_kind(recs[0].reason) == reason_kind(branch_records(rep)[0].reason)
    assert_close(ref, got.call(X))


def test_branches_on_different_inputs_are_no_candidate():
    f = lambda x: bn(conv(x, K3), B1) + bn(conv(jnp.tanh(x), K1, pad=0), B2)   # noqa: E731
    _, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    _, srep = hlofold.fold_stablehlo(jax.export.export(jax.jit(f))(X))
    assert not branch_records(rep) and not branch_records(srep)
    assert rep.num_folded == srep.num_folded == 2
