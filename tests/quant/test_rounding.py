"""A rounding between layers, read from the registries' ``rounding`` fact on both paths.

``lax.reduce_precision`` rounds float32 values to fewer mantissa bits without changing their
type. The jaxpr path's pair rules listed it among the identities, so ``equalize=``/``smooth=``
moved scales that are not powers of two across it — with example inputs of zeros a silently
wrong tree (2.5e-3 off on fresh inputs where 1e-5 is promised) — while the StableHLO path
stopped the pair there (issue 66 item 2, issue 68 item 1). Now both read the one fact: a
rounding passes powers of two only (the model computes what the fold alone computes, bit for
bit), as a bfloat16 round trip does; and a rotation, which commutes with no rounding, is
refused where the residual stream is rounded (issue 68 item 3)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold._ir.jaxpr import ops as jaxpr_ops
from hlofold._ir.stablehlo import ops as stablehlo_ops
from tests.quant.jaxpr.test_equalize import rel
from tests.quant.stablehlo.test_equalize import _exported, _two_convs, bit_for_bit


def _rp(y):
    return lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7)     # bfloat16's


def test_both_registries_say_reduce_precision_rounds():
    assert jaxpr_ops.of("reduce_precision").rounding == "always"
    assert stablehlo_ops.of("stablehlo.reduce_precision").rounding == "always"
    assert jaxpr_ops.of("convert_element_type").rounding == "narrowing"
    assert stablehlo_ops.of("stablehlo.convert").rounding == "narrowing"
    assert jaxpr_ops.of("reduce_precision").shape is None       # no identity on the values


def test_reduce_precision_between_layers_makes_the_scales_powers_of_two():
    f, p, rng = _two_convs(_rp, 1)
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32)
    out, rep = bit_for_bit(f, p, x)
    assert len(out.equalized) == len(rep.equalized) == 1


@pytest.mark.parametrize("rewrite", ["equalize", "smooth"])
def test_example_inputs_of_zeros_do_not_hide_the_rounding(rewrite):
    """The issue's case: only the example's shapes and dtypes matter, so zeros are a fair
    example; the tree must then hold on fresh inputs, bit for bit against the fold alone."""
    f, p, rng = _two_convs(_rp, 2)
    zeros = jnp.zeros((2, 6, 6, 3), jnp.float32)
    calib = [jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32) for _ in range(2)]
    kw = {"equalize": True} if rewrite == "equalize" else {"smooth": calib}
    out = hlofold.fold_params(f, p, zeros, **kw)
    done = out.equalized + out.smoothed
    assert done and all(e.powers_of_two for e in done), str(out)
    plain = hlofold.fold_params(f, p, zeros)
    fresh = jnp.asarray(rng.standard_normal((2, 6, 6, 3)) * 3, jnp.float32)
    np.testing.assert_array_equal(f(out.params, fresh), f(plain.params, fresh))
    exp, leaves, _ = _exported(f, p, zeros)
    bound = {i: np.asarray(a) for i, a in enumerate(leaves)}
    skw = {"equalize": True} if rewrite == "equalize" else {"smooth": [[c] for c in calib]}
    got, srep, prep = hlofold.fold_stablehlo(exp, params=bound, **skw)
    base, _, pbase = hlofold.fold_stablehlo(exp, params=bound)
    done = srep.equalized + srep.smoothed
    assert done and all(e.powers_of_two for e in done), str(srep)
    np.testing.assert_array_equal(got.call(fresh, *prep), base.call(fresh, *pbase))


def _tiny_decoder(store):
    """A one-block RMSNorm decoder whose residual stream is stored by ``store`` between the
    blocks (a float32 stream kept in bfloat16, a common mixed-precision layout)."""
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa

    def rms(x, g):
        return x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
    p = {"embed": w(16, 8), "g": jnp.asarray(1 + rng.random(8), jnp.float32), "w": w(8, 8),
         "o": w(8, 8), "gf": jnp.asarray(1 + rng.random(8), jnp.float32), "head": w(8, 16)}

    def f(p, t):
        x = p["embed"][t]
        x = store(x + rms(x, p["g"]) @ p["w"] @ p["o"])
        return rms(x, p["gf"]) @ p["head"]
    return f, p, jnp.asarray([[1, 2, 3]])


@pytest.mark.parametrize("store,to", [
    (_rp, "7 mantissa bits (reduce_precision)"),
    (lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), "bfloat16")])
def test_rotation_refuses_a_rounded_residual_stream(store, to):
    f, p, t = _tiny_decoder(store)
    out = hlofold.fold_params(f, p, t, rotate=True)
    assert out.rotation is not None and out.rotation.reason is not None, str(out)
    assert f"rounded to {to}" in out.rotation.reason and "rounding" in out.rotation.reason
    assert rel(f(p, t), f(out.params, t)) <= 1e-5


def test_rotation_of_the_same_stream_without_the_rounding_still_rotates():
    f, p, t = _tiny_decoder(lambda x: x)
    out = hlofold.fold_params(f, p, t, rotate=True)
    assert out.rotation.reason is None, str(out)
    assert rel(f(p, t), f(out.params, t)) <= 1e-4
    widened = _tiny_decoder(lambda x: x.astype(jnp.float64 if jax.config.jax_enable_x64
                                               else jnp.float32))
    assert hlofold.fold_params(*widened, rotate=True).rotation.reason is None


def test_a_wrong_rewrite_is_caught_on_random_inputs_where_the_example_is_degenerate(
        monkeypatch):
    """fold_params checks a rewritten tree on random inputs of the example's shapes too
    (issue 68, item 2): the old reading of reduce_precision (an identity to the pair walk),
    put back here, passed its check on an example of zeros and returned a wrong tree; now the
    check on fresh inputs raises instead of returning it."""
    from hlofold._quant.jaxpr import pair_rules, pairs
    monkeypatch.setattr(pairs, "ROUNDING", frozenset())
    monkeypatch.setitem(pair_rules.RULES, "reduce_precision", lambda ctx, e, pos, axis: axis)
    f, p, rng = _two_convs(_rp, 2)
    zeros = jnp.zeros((2, 6, 6, 3), jnp.float32)
    with pytest.raises(RuntimeError, match="on random inputs of the example's shapes"):
        hlofold.fold_params(f, p, zeros, equalize=True)


def test_the_random_check_keeps_an_example_s_placement_and_integer_inputs():
    """Token ids stay valid indices (0 or 1), and a rewrite of a decoder checks as before."""
    from benchmarks.quantization import smooth_case
    f, p, x, calib = smooth_case("decoder", 0)
    out = hlofold.fold_params(f, p, *x, smooth=calib)
    assert out.smoothed
    assert rel(f(p, *x), f(out.params, *x)) <= 1e-5


def test_a_wrong_stablehlo_rewrite_is_caught_on_random_inputs(monkeypatch):
    """fold_stablehlo checks a module rewritten for quantization on random inputs too, on
    every JAX (issue 68, item 2), as fold_params does: the old StableHLO reading put back as
    an identity (the jaxpr path's old bug) raises instead of returning a wrong module."""
    from hlofold._quant.stablehlo import pair_rules, pairs
    monkeypatch.setattr(pairs, "ROUNDING", frozenset())
    monkeypatch.setitem(pair_rules.RULES, "stablehlo.reduce_precision",
                        pair_rules.RULES["stablehlo.negate"])        # (the channel as it is)
    f, p, rng = _two_convs(_rp, 2)
    exp, leaves, _ = _exported(f, p, jnp.zeros((2, 6, 6, 3), jnp.float32))
    bound = {i: np.asarray(a) for i, a in enumerate(leaves)}
    with pytest.raises(RuntimeError, match="changes the outputs on random inputs"):
        hlofold.fold_stablehlo(exp, params=bound, equalize=True)
    text = exp.mlir_module()
    with pytest.raises(RuntimeError, match="changes the outputs on random inputs"):
        hlofold.fold_stablehlo(text, params={f"arg{i}": a for i, a in bound.items()},
                               equalize=True)
