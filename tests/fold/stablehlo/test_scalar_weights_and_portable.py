"""Regressions for the third round of adversarial testing (issue 31), StableHLO artifacts:
scalar (0-d) weights given as values, and portable artifacts folded in the graph. Each failed
before its fix."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.mlir.dialects import stablehlo as shlo

import hlofold
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._ir.stablehlo.module import parse_module
from tests.helpers import assert_close

DN = ("NHWC", "HWIO", "NHWC")
RNG = np.random.default_rng(31)
X = jnp.asarray(RNG.standard_normal((1, 6, 6, 3)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((3, 3, 3, 4)), jnp.float32)
S = jnp.asarray(RNG.random(4) + 0.5, jnp.float32)
T = jnp.asarray(RNG.standard_normal(4), jnp.float32)
FLAG, SCALE = jnp.asarray(1.0, jnp.float32), jnp.asarray(2.0, jnp.float32)
W = jnp.asarray(RNG.standard_normal((4, 5)), jnp.float32)


def conv_bn(x, k, s, t):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DN) * s + t


def with_scalars(x, k, s, t, flag, scale):
    """A scalar flag read by a compare, a scalar scale after a dot: 0-d weights."""
    y = jnp.where(flag > 0, conv_bn(x, k, s, t), 0.0)
    return (y.reshape(-1, 4) @ W) * scale


WEIGHTS = {"arg1": K, "arg2": S, "arg3": T, "arg4": FLAG, "arg5": SCALE}


def test_scalar_weights_given_as_values_fold():
    """``fold_stablehlo(params=)`` made every weight at least 1-d (``np.ascontiguousarray``)
    and raised an MLIRError on a 0-d one."""
    text = jax.jit(with_scalars).lower(X, K, S, T, FLAG, SCALE).as_text()
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=WEIGHTS)
    assert rep.num_folded == 2, str(rep)                 # the conv's BN, the dot's scale
    ref = with_scalars(X, K, S, T, FLAG, SCALE)
    assert_close(ref, module_callable(apply)(X, *prepared)[0])
    app, rep2, prep = hlofold.fold_stablehlo(text, split=["arg0"])
    outs = module_callable(prep)(*[WEIGHTS[f"arg{i}"] for i in range(1, 6)])
    assert bool(outs[-1])                                 # ok
    assert_close(ref, module_callable(app)(X, *outs[:-1])[0])


def test_scalar_weights_on_the_command_line(tmp_path):
    """``hlofold fold --params`` with a 0-d weight exited 1 with a traceback."""
    src = tmp_path / "m.mlir"
    src.write_text(jax.jit(with_scalars).lower(X, K, S, T, FLAG, SCALE).as_text())
    np.savez(tmp_path / "w.npz", **{k: np.asarray(v) for k, v in WEIGHTS.items()})
    np.savez(tmp_path / "in.npz", np.asarray(X), *[np.asarray(v) for v in WEIGHTS.values()])
    r = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o",
                        str(tmp_path / "apply.mlir"), "--params", str(tmp_path / "w.npz"),
                        "--prepared-out", str(tmp_path / "p.npz")],
                       capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    prepared = [np.asarray(v) for v in np.load(tmp_path / "p.npz").values()]
    out = module_callable((tmp_path / "apply.mlir").read_text())(X, *prepared)[0]
    assert_close(with_scalars(X, K, S, T, FLAG, SCALE), out)


@pytest.mark.parametrize("target", ["1.0.0", shlo.get_current_version()])
def test_a_portable_artifact_folded_in_the_graph_stays_a_portable_artifact(target):
    """``fold_stablehlo(vhlo, in_graph=True)`` raised "failed to serialize module": the
    guard's marker was an attribute VHLO cannot express. It is a frontend attribute now
    (kept by every serialization, ignored by XLA), and the output keeps the input's kind."""
    text = jax.jit(conv_bn).lower(X, K, S, T).as_text()
    art = shlo.serialize_portable_artifact_str(text, target)
    out, rep = hlofold.fold_stablehlo(art, in_graph=True)
    assert rep.num_folded == 1 and rep.folded[0].guarded, str(rep)
    assert isinstance(out, bytes) and out[5:].startswith(f"StableHLO_v{target}\0".encode())
    back = str(parse_module(shlo.deserialize_portable_artifact_str(out)))
    assert "hlofold_guard" in back and "stablehlo.if" in back
    assert_close(conv_bn(X, K, S, T), module_callable(out)(X, K, S, T)[0])
    again, rep2 = hlofold.fold_stablehlo(out, in_graph=True)      # the guard is recognized
    assert rep2.num_folded == 0 and again == out


# ------------------------------------------------------------ a second consumer: IREE


def _iree():
    import hlofold._front.iree as iree
    if "iree:llvm-cpu" not in iree.runtimes():
        pytest.skip("IREE (iree-base-compiler, iree-base-runtime) is not installed")


@pytest.mark.parametrize("module", ["keras_tf_args.mlir", "conv_bn_inference_nchw.mlir"])
def test_verify_runs_folded_and_original_on_iree_beside_xla(module):
    """TensorFlow's module (weights folded once, ``params=``) and a ``batch_norm_inference``
    module folded as constants: IREE compiles both, and ``verify`` compares them there with
    the tolerance model, in rows beside XLA's CPU."""
    _iree()
    from tests.helpers import DATA
    text = open(os.path.join(DATA, module)).read()
    if module == "keras_tf_args.mlir":
        weights = dict(np.load(os.path.join(DATA, "keras_tf_args.npz")))
        x = np.load(os.path.join(DATA, "keras_tf_io.npz"))["x"]
        apply, rep, prepared = hlofold.fold_stablehlo(text, params=weights)
        original = module_callable(text)
        folded = lambda x: module_callable(apply)(x, *prepared)        # noqa: E731
        args = [x]
        orig_all = lambda x: original(x, *[weights[f"arg{i}"]           # noqa: E731
                                           for i in range(1, len(weights) + 1)])
        vrep = hlofold.verify(orig_all, folded, *args)
    else:
        folded, rep = hlofold.fold_stablehlo(text)
        args = [np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)]
        vrep = hlofold.verify(text, folded, *args)
    assert rep.num_folded >= 1
    assert "iree:llvm-cpu" in vrep.backends and vrep.passed, str(vrep)
    rows = {(r.backend, r.against) for r in vrep.rows}
    assert {("cpu", "same backend"), ("iree:llvm-cpu", "same backend"),
            ("iree:llvm-cpu", "cpu original")} <= rows
    assert "IREE llvm-cpu" in str(vrep)


def test_iree_catches_a_wrong_fold_too():
    _iree()
    text = jax.jit(conv_bn).lower(X, K, S, T).as_text()
    wrong = jax.jit(lambda x, k, s, t: conv_bn(x, k * 1.01, s, t)).lower(X, K, S, T).as_text()
    vrep = hlofold.verify(text, wrong, X, K, S, T, backends=["iree:llvm-cpu"],
                          raise_on_failure=False)
    assert vrep.backends == ["iree:llvm-cpu"] and not vrep.passed, str(vrep)
