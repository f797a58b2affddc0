"""StableHLO modules whose weights are arguments, folded for given weight values
(``fold_stablehlo(..., params=)``, ``hlofold fold --params``): TensorFlow's own output for a
Keras model (checked in, see testdata/stablehlo/make_keras_tf.py) and a ``jax.export``
artifact. The apply module does no more work per call than the original."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import DATA, flat_resnet
from hlofold import examples
from hlofold._ir.stablehlo.artifacts import input_specs, module_callable

TF_MODULE = os.path.join(DATA, "keras_tf_args.mlir")
TF_WEIGHTS = dict(np.load(os.path.join(DATA, "keras_tf_args.npz")))
TF_IO = dict(np.load(os.path.join(DATA, "keras_tf_io.npz")))


def ops(text: str, name: str) -> int:
    main = text[text.index("func.func @main"):]
    return main.count(f"stablehlo.{name}")


def main_ops(text: str) -> int:
    main = text[text.index("func.func @main"):]
    return main.count(" = stablehlo.")


def test_tensorflow_keras_module_folds_its_weights_once():
    text = open(TF_MODULE).read()
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=TF_WEIGHTS)
    assert rep.num_folded == 3 and rep.num_refused == 0, str(rep)
    assert {s.rescale for s in rep.folded} == {"constant"}      # folded on the host
    # the apply module: the image, then the folded weights; no BN arithmetic left
    specs = input_specs(apply)
    assert len(specs) == 1 + len(prepared)
    assert tuple(specs[0].shape) == TF_IO["x"].shape
    assert ops(apply, "rsqrt") == 0 and ops(apply, "convolution") == 3
    assert "dense<[" not in apply.split("func.func @main")[1], \
        "weights are arguments, not constants in the module text"
    # no more work per call than TensorFlow's module: fewer ops, the same convolutions
    assert main_ops(apply) < main_ops(text)
    out = module_callable(apply)(TF_IO["x"], *prepared)
    y = TF_IO["y"]
    err = float(np.max(np.abs(np.asarray(out[0]) - y)))
    assert err <= 1e-5 * float(np.max(np.abs(y))) + 1e-6, err   # against TensorFlow itself


@pytest.mark.parametrize("name,sites", [("keras_tf_args.mlir", 3),
                                        ("conv_bn_inference_nhwc_args.mlir", 1)])
def test_without_weight_values_argument_sites_are_left_as_they_are(name, sites):
    """Never costlier than the original: without the weight values a site whose weights are
    arguments would rescale its kernel on every call, so by default it is reported, with the
    way to fold it, and the module keeps its ops; in_graph=True folds it, guarded."""
    text = open(os.path.join(DATA, name)).read()
    out, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 0 and rep.num_refused == sites, str(rep)
    assert all("params=" in s.reason and "in_graph=True" in s.reason for s in rep.refused)
    assert out == text, "nothing folded: the module exactly as it was given"
    out, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == sites and all(s.guarded for s in rep.folded)
    r = _cli("report", os.path.join(DATA, name))
    assert r.returncode == 0 and "--params" in r.stdout


def test_weights_whose_fold_is_unsafe_refuse_their_site():
    text = open(TF_MODULE).read()
    orig = module_callable(text)
    # arg3 is the first BatchNorm's moving variance (TF adds ε = 1e-3 to it, then rsqrt):
    # σ² = −ε on one channel makes s = inf there
    bad = dict(TF_WEIGHTS)
    bad["arg3"] = TF_WEIGHTS["arg3"].copy()
    bad["arg3"][2] = -1e-3
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=bad)
    assert rep.num_refused == 1 and "not finite" in rep.refused[0].reason, str(rep)
    assert rep.num_folded == 2
    ref = np.asarray(orig(TF_IO["x"], *[bad[f"arg{i}"] for i in range(1, 19)])[0])
    out = np.asarray(module_callable(apply)(TF_IO["x"], *prepared)[0])
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))


@pytest.mark.parametrize("params,match", [
    ({"arg1": np.zeros((3, 3, 3, 9), np.float32)}, r"arg1: shape \(3, 3, 3, 9\)"),
    ({"arg1": np.zeros((3, 3, 3, 8), np.float64)}, "arg1: dtype float64"),
    ({"arg40": np.zeros(3, np.float32)}, "takes 19 arguments"),
    ({"kernel": np.zeros(3, np.float32)}, "does not name a module argument"),
])
def test_bad_weights_are_named(params, match):
    with pytest.raises(hlofold.StableHLOError, match=match):
        hlofold.fold_stablehlo(open(TF_MODULE).read(), params=params)


def test_jax_export_with_weight_arguments():
    f, P, leaves, x = flat_resnet()
    exp = jax.export.export(jax.jit(f))(*leaves, x)
    params = {f"arg{i}": np.asarray(l) for i, l in enumerate(leaves)}
    new, rep, prepared = hlofold.fold_stablehlo(exp, params=params)
    assert isinstance(new, jax.export.Exported)
    # on the device already: a NumPy argument would be copied to it on every call
    assert all(isinstance(p, jax.Array) for p in prepared)
    assert rep.num_folded == examples.count_bn(P) + 1, str(rep)  # and the pool's 1/HW, folded forward into the head (both paths)
    ref = exp.call(*leaves, x)
    out = new.call(x, *prepared)
    err = float(jnp.max(jnp.abs(ref - out)))
    assert err <= 1e-5 * float(jnp.max(jnp.abs(ref))) + 1e-6, err
    # serialized in, serialized out
    blob, _, prepared2 = hlofold.fold_stablehlo(exp.serialize(), params=params)
    out2 = jax.export.deserialize(blob).call(x, *prepared2)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(out), rtol=0, atol=0)


def _cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "hlofold", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_params(tmp_path):
    w, x = tmp_path / "w.npz", tmp_path / "x.npz"
    np.savez(w, **TF_WEIGHTS)
    np.savez(x, arg0=TF_IO["x"])
    out, prep = tmp_path / "apply.mlir", tmp_path / "prepared.npz"
    r = _cli("fold", TF_MODULE, "-o", str(out), "--params", str(w), "--prepared-out",
             str(prep), "--verify", "--inputs", str(x))
    assert r.returncode == 0, r.stderr
    assert "hlofold verify: PASS" in r.stdout
    z = np.load(prep)
    assert z.files[0] == "arg1" and len(z.files) == len(input_specs(out.read_text())) - 1
    y = module_callable(out.read_text())(TF_IO["x"], *[z[k] for k in z.files])[0]
    np.testing.assert_allclose(np.asarray(y), TF_IO["y"], rtol=1e-5, atol=1e-6)

    # usage errors: exit 2, nothing written
    out2, prep2 = tmp_path / "a2.mlir", tmp_path / "p2.npz"
    r = _cli("fold", TF_MODULE, "-o", str(out2), "--params", str(w))
    assert r.returncode == 2 and "--prepared-out" in r.stderr and not out2.exists()
    bad = tmp_path / "bad.npz"
    np.savez(bad, kernel=np.zeros(3))
    r = _cli("fold", TF_MODULE, "-o", str(out2), "--params", str(bad), "--prepared-out",
             str(prep2))
    assert r.returncode == 2 and "does not name a module argument" in r.stderr
    assert not out2.exists() and not prep2.exists()


# ----------------------------------------------------- prepare/apply modules (split=)


def _tf_weights():
    return [TF_WEIGHTS[f"arg{i}"] for i in range(1, len(TF_WEIGHTS) + 1)]


def test_split_makes_a_prepare_and_an_apply_module():
    """For a runtime without hlofold: prepare (weights in, folded weights and ok out) runs
    once; apply runs one convolution and one add per folded site, nothing on the weights."""
    text = open(TF_MODULE).read()
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=["arg0"])
    assert rep.num_folded == 3, str(rep)
    float_muls = [l for l in apply.splitlines() if "stablehlo.multiply" in l and "xf32>" in l]
    assert not float_muls and ops(apply, "if") == 0, apply
    assert ops(apply, "convolution") == ops(text, "convolution")
    assert main_ops(apply) < main_ops(text)
    assert "hlofold." not in apply + prepare          # no internal markers left behind
    *prepared, ok = module_callable(prepare)(*_tf_weights())
    assert bool(ok) and len(input_specs(apply)) == 1 + len(prepared)
    # apply reads no activation-sized broadcast of a weight: every prepared array is at
    # most as large as the largest weight
    assert max(p.size for p in prepared) <= max(w.size for w in _tf_weights())
    y = module_callable(apply)(TF_IO["x"], *prepared)[0]
    np.testing.assert_allclose(np.asarray(y), TF_IO["y"], rtol=1e-5, atol=1e-6)
    # bytecode in, bytecode out (both modules)
    import io
    from hlofold._fold.stablehlo.fold import parse_module
    buf = io.BytesIO()
    with parse_module(text).context as _:
        parse_module(text).operation.write_bytecode(buf)
    a2, _, p2 = hlofold.fold_stablehlo(buf.getvalue(), split=[0])
    assert a2[:4] == p2[:4] == b"ML\xefR"


def test_split_prepare_says_when_the_weights_do_not_fold():
    """A BatchNorm parameter that is NaN: a folded kernel or bias is not finite, prepare's
    ok is false (run the original module), as the guard would fall back in the graph;
    finite weights give ok. (An inf variance is fine: rsqrt gives s = 0, a finite fold.)"""
    text = open(TF_MODULE).read()
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=["arg0"])
    assert bool(module_callable(prepare)(*_tf_weights())[-1])
    for k, w in enumerate(_tf_weights()):
        if w.shape == (8,):                     # a BN vector of the first two sites
            bad = _tf_weights()
            bad[k] = np.full_like(w, np.nan)
            assert not bool(module_callable(prepare)(*bad)[-1]), k


def test_split_usage_errors(tmp_path):
    text = open(TF_MODULE).read()
    with pytest.raises(hlofold.StableHLOError,
                       match=r"@main takes 19 arguments \(arg0 .. arg18\)"):
        hlofold.fold_stablehlo(text, split=["arg99"])
    with pytest.raises(hlofold.StableHLOError, match="name at least one"):
        hlofold.fold_stablehlo(text, split=[])
    # one argument need not be a list
    assert hlofold.fold_stablehlo(text, split="arg0")[0] == hlofold.fold_stablehlo(
        text, split=["arg0"])[0]
    with pytest.raises(ValueError, match="exclude each other"):
        hlofold.fold_stablehlo(text, split=["arg0"], params=TF_WEIGHTS)
    exp = jax.export.export(jax.jit(lambda x: x * 2))(jnp.ones(3))
    with pytest.raises(hlofold.StableHLOError, match="params="):
        hlofold.fold_stablehlo(exp, split=[0])
    out, prep = tmp_path / "apply.mlir", tmp_path / "prepare.mlir"
    r = _cli("fold", TF_MODULE, "-o", str(out), "--prepare", str(prep))
    assert r.returncode == 2 and "--per-call" in r.stderr
    assert not out.exists() and not prep.exists()


@pytest.mark.slow
def test_cli_prepare_module(tmp_path):
    out, prep = tmp_path / "apply.mlir", tmp_path / "prepare.mlir"
    r = _cli("fold", TF_MODULE, "-o", str(out), "--prepare", str(prep), "--per-call", "arg0",
             "--verify")
    assert r.returncode == 0, r.stderr
    assert "hlofold verify: PASS" in r.stdout
    *prepared, ok = module_callable(prep.read_text())(*_tf_weights())
    y = module_callable(out.read_text())(TF_IO["x"], *prepared)[0]
    np.testing.assert_allclose(np.asarray(y), TF_IO["y"], rtol=1e-5, atol=1e-6)
