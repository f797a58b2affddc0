"""Forward folds (an affine *in front of* a root) on both paths: the same decision per site,
the same reason kind for each refusal, and the unfolded program's outputs.

``tests/fold/jaxpr/test_forward.py`` covers the geometry of the jaxpr path in depth (bias maps of every
padding, layouts, per-token factors); these tests hold the StableHLO path to the same rules
(``_fold.core.decide.forward_refusal``, ``_fold.core.patterns.border_masks``, ``_fold.core.rules.bias_map_refusal``) on the
programs both can read.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hlofold._base.reasons import reason_kind
from tests.helpers import fold_both, max_err

RNG = np.random.default_rng(11)
DN = ("NHWC", "HWIO", "NHWC")


def _f32(*shape, lo=None, hi=None):
    if lo is not None:
        return RNG.uniform(lo, hi, shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def _forward(rep):
    """(status, reason kind) of the forward sites, in order."""
    return [(s.status, reason_kind(s.reason) if s.status == "refused" else None)
            for s in rep.sites if "affine_" in s.pattern.replace("stablehlo_", "")[:7]]


def _backward(rep):
    return collections.Counter(
        (s.status, reason_kind(s.reason) if s.status == "refused" else None)
        for s in rep.sites if "_affine" in s.pattern and "affine_" not in s.pattern)


def _same_decisions(results):
    (_, rj, _, _), (_, rs, _, _) = results
    assert _forward(rj) == _forward(rs), (str(rj), str(rs))
    assert _backward(rj) == _backward(rs), (str(rj), str(rs))
    return _forward(rj)


def _close(results, ref, rel=2e-5):
    for path, rep, out, _ in results:
        err = max_err(ref, out)
        assert err <= rel * float(np.max(np.abs(ref))) + 1e-6, (path, err, str(rep))


def _conv(h, k, padding="VALID", groups=1):
    return lax.conv_general_dilated(h, k, (1, 1), padding, dimension_numbers=DN,
                                    feature_group_count=groups)


X = _f32(2, 9, 9, 4)
MEAN, STD = _f32(4), _f32(4, lo=0.5, hi=2.0)
K = _f32(3, 3, 4, 6)
G, B = _f32(6, lo=0.5, hi=2.0), _f32(6)


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("params", ["constants", "arguments"])
def test_input_normalization_folds_into_the_first_conv(padding, params):
    """``(x − mean) / std`` in front of a conv (+ BatchNorm after it): with constants both
    fold it into the kernel and a bias (a bias map where SAME padding hides the shift from
    the border); with weights as arguments the scale folds in the graph and a shift before
    a padded conv is refused (a bias map is made only of values known now)."""
    def net(x, k, mean, std, g, b):
        return _conv((x - mean) / std, k, padding) * g + b
    if params == "constants":
        results, ref, _ = fold_both(lambda x: net(x, K, MEAN, STD, G, B), X)
    else:
        results, ref, _ = fold_both(net, X, K, MEAN, STD, G, B)
    fwd = _same_decisions(results)
    if params == "arguments" and padding == "SAME":
        assert fwd == [("refused", "bias-map")]
    else:
        assert fwd == [("folded", None)]
    if params == "constants":          # nothing of the affine is left to compute
        for path, rep, _, prog in results:
            text = str(prog)
            assert "divide" not in text and " div " not in text, path
    _close(results, ref)


def test_scale_only_in_front_of_a_padded_conv_folds_with_arguments():
    """A scale needs no bias map (the padded zeros stay zero): it folds in the graph."""
    def net(x, k, std):
        return _conv(x * std, k, "SAME")
    results, ref, _ = fold_both(net, X, K, STD)
    assert _same_decisions(results) == [("folded", None)]
    _close(results, ref)


def test_grouped_conv_reads_each_groups_inputs():
    k = _f32(3, 3, 2, 6)             # 2 groups of 2 input channels
    for args in ((X,), (X, k, MEAN, STD)):
        def net(x, k=k, mean=MEAN, std=STD):
            return _conv((x - mean) * std, k, "VALID", groups=2)
        results, ref, _ = fold_both(net, *args)
        assert _same_decisions(results) == [("folded", None)]
        _close(results, ref)


def test_dense_layer_takes_the_affine_in_front():
    w = _f32(4, 5)
    x = _f32(3, 4)

    def net(x):
        return jnp.dot(x * STD + MEAN, w)
    results, ref, _ = fold_both(net, x)
    assert _same_decisions(results) == [("folded", None)]
    _close(results, ref)


def test_two_linear_readers_each_take_the_chain_and_any_other_reader_refuses():
    k2 = _f32(1, 1, 4, 3)

    def both_convs(x):
        h = (x - MEAN) * STD
        return _conv(h, K) .sum() + _conv(h, k2).sum()
    results, ref, _ = fold_both(both_convs, X)
    assert _same_decisions(results) == [("folded", None)] * 2
    _close(results, ref, rel=1e-4)

    def conv_and_tanh(x):
        h = (x - MEAN) * STD
        return _conv(h, K).sum() + jnp.tanh(h).sum()
    results, ref, unchanged = fold_both(conv_and_tanh, X)
    assert _same_decisions(results) == [("refused", "consumers")]
    assert unchanged == {"jaxpr": True, "stablehlo": True}
    _close(results, ref, rel=1e-4)


def test_an_operand_computed_from_the_input_is_not_a_parameter():
    """``x − mean(x)`` (a statistic of the input itself) is not folded on either path."""
    def net(x):
        return _conv(x - jnp.mean(x, axis=(0, 1, 2)), K)
    results, ref, unchanged = fold_both(net, X)
    assert _same_decisions(results) == []
    assert unchanged == {"jaxpr": True, "stablehlo": True}


def test_a_shift_the_cost_rule_refuses_is_refused_on_both_paths():
    """A stem at batch 1 whose map (one output) is larger than the input pass it removes."""
    x = _f32(1, 8, 8, 3)
    k = _f32(3, 3, 3, 64)

    def net(x):
        return _conv(x + MEAN[:3], k, "SAME")
    results, ref, unchanged = fold_both(net, x)
    assert _same_decisions(results) == [("refused", "bias-map")]
    assert unchanged == {"jaxpr": True, "stablehlo": True}


def test_a_non_finite_input_scale_is_refused_on_both_paths():
    def net(x):
        return _conv(x * np.array([1.0, np.inf, 1.0, 1.0], np.float32), K)
    results, ref, unchanged = fold_both(net, X)
    assert _same_decisions(results) == [("refused", "not-finite")]
    assert unchanged == {"jaxpr": True, "stablehlo": True}


def test_float64_forward_fold_keeps_float64_precision():
    with jax.enable_x64(True):
        x, k = X.astype(np.float64), K.astype(np.float64)
        mean, std = MEAN.astype(np.float64), STD.astype(np.float64)
        for args, net in (((x,), lambda x: _conv((x - mean) / std, k)),
                          ((x, k, mean, std), lambda x, k, m, s: _conv((x - m) / s, k))):
            results, ref, _ = fold_both(net, *args)
            assert _same_decisions(results) == [("folded", None)]
            for path, rep, out, _ in results:
                assert max_err(ref, out) <= 1e-12 * float(np.max(np.abs(ref))), path
