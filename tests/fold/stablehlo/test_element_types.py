"""Every element type a module may hold is read or passed through (issue 68, item 7): a
complex constant anywhere in a module crashed ``fold_stablehlo(art, params=…)`` (the bindings
have no Python class for complex dense elements, so reading its ``value`` raised ``TypeError:
Can't cast unknown element type complex<f32>``) and the CLI's ``--params`` exited 4."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold


def _program(rng):
    k = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    g, b, m = (rng.standard_normal(4).astype(np.float32) for _ in range(3))
    v = (rng.random(4) + 0.5).astype(np.float32)

    def f(k, g, b, m, v, x):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = (y - m) * lax.rsqrt(v + 1e-3) * g + b
        c = jnp.asarray(np.array([1 + 2j, 3 - 1j, 0.5j], np.complex64))
        return y, jnp.real(c * jnp.exp(c)).astype(jnp.float32)
    return f, [k, g, b, m, v]


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    f, w = _program(rng)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    text = jax.jit(f).lower(*w, x).as_text()
    assert "complex<f32>" in text
    return f, w, x, text


def test_a_complex_constant_passes_through_fold_stablehlo_params(case):
    f, w, x, text = case
    apply, rep, prep = hlofold.fold_stablehlo(text, params={f"arg{i}": a for i, a in
                                                            enumerate(w)})
    assert rep.num_folded == 1, str(rep)
    assert "complex<f32>" in apply and "batch_norm" not in apply
    got = hlofold.callable(apply)(x, *prep)
    ref = f(*w, x)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    # (the complex output: what XLA computes of the same ops, compiled or not: an ulp)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-6)


def test_a_complex_constant_in_the_graph_and_split_modes(case):
    f, w, x, text = case
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == 1 and "complex<f32>" in folded
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=["arg5"])
    *prepared, ok = hlofold.callable(prepare)(*w)
    assert bool(ok) and rep.num_folded == 1
    got = hlofold.callable(apply)(x, *prepared)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(f(*w, x)[0]), rtol=1e-5,
                               atol=1e-5)


def test_the_cli_params_with_a_complex_constant(case, tmp_path):
    f, w, x, text = case
    src, out, prep = tmp_path / "m.mlir", tmp_path / "o.mlir", tmp_path / "p.npz"
    src.write_text(text)
    np.savez(tmp_path / "w.npz", **{f"arg{i}": a for i, a in enumerate(w)})
    r = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                        "--params", str(tmp_path / "w.npz"), "--prepared-out", str(prep)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "complex<f32>" in out.read_text()


# every element type a module may hold beside the layer, as a non-splat constant the
# program computes with (dense elements the bindings read one way or not at all)
TYPES = {"complex64": "complex<f32>", "bfloat16": "bf16", "float16": "f16",
         "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2", "int4": "i4", "int8": "i8",
         "uint8": "ui8", "uint32": "ui32", "bool": "i1"}


@pytest.mark.parametrize("dtype", TYPES)
def test_a_constant_of_each_element_type_passes_through_every_mode(dtype):
    """A conv + BatchNorm beside ``x.mean()`` combined with a constant of ``dtype``:
    ``params=``, ``in_graph=True`` and ``split=`` fold the layer, keep the constant's type
    in the module, and compute what the module given computes."""
    rng = np.random.default_rng(1)
    f0, w = _program(rng)
    dt = jnp.dtype(dtype)
    c = jnp.asarray(np.array([1, 0, 1] if dtype == "bool" else [1, 2, 3]).astype(dt))

    def f(k, g, b, m, v, x):
        y = f0(k, g, b, m, v, x)[0]
        s = x.mean() > 0 if dtype == "bool" else x.mean().astype(dt)
        return y, (s ^ c if dtype == "bool" else s + c).astype(jnp.float32)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    text = jax.jit(f).lower(*w, x).as_text()
    held = f"tensor<3x{TYPES[dtype]}>"
    assert held in text                   # (the constant's type is in the module)
    ref = hlofold.callable(text)(*w, x)
    apply, rep, prep = hlofold.fold_stablehlo(text, params={f"arg{i}": a for i, a in
                                                            enumerate(w)})
    assert rep.num_folded == 1 and "batch_norm" not in apply and held in apply, str(rep)
    got = hlofold.callable(apply)(x, *prep)
    folded, rep2 = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep2.num_folded == 1 and held in folded
    apply3, rep3, prepare = hlofold.fold_stablehlo(text, split=["arg5"])
    *prepared, ok = hlofold.callable(prepare)(*w)
    assert bool(ok) and rep3.num_folded == 1
    for out in (got, hlofold.callable(folded)(*w, x), hlofold.callable(apply3)(x, *prepared)):
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
