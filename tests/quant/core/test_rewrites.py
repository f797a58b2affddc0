"""The rewrites as values and their one driver (``hlofold._quant.core.rewrites``): chains
compose in order, the keyword options build the chain ``fold_params`` always ran (rotate,
equalize, smooth), each rewrite's records in its own fields on both paths, and every layer
a rewrite leaves carries a reason with a kind — the same kind on both paths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._base.reasons import KINDS
from hlofold._quant.core import rewrites as R
from hlofold._quant.core.rotation import Rotation


class _Recording:
    """A view that records which rewrite ran, in order (the driver's contract only)."""

    def __init__(self):
        self.calls = []

    def rotate(self, seed):
        self.calls.append(("rotate", seed))
        return Rotation(None, 4)

    def equalize(self):
        self.calls.append(("equalize",))
        return ["e"], ["left-e"]

    def smooth(self, calibration, alpha):
        self.calls.append(("smooth", len(calibration), alpha))
        return ["s"], ["left-s"]


def test_a_chain_flattens_in_order_and_refuses_what_is_not_a_rewrite():
    a, b, c = R.Rotate(3), R.Equalize(), R.Smooth((1, 2), 0.25)
    assert R.chain(a, (b, (c,))) == (a, b, c)
    assert R.chain() == ()
    with pytest.raises(TypeError, match="not a rewrite: 'equalize'"):
        R.chain(a, "equalize")
    view = _Recording()
    got = R.run(R.chain(c, a, b), view)           # the order given is the order run
    assert view.calls == [("smooth", 2, 0.25), ("rotate", 3), ("equalize",)]
    assert (got.equalized, got.not_equalized, got.smoothed, got.not_smoothed) == \
        (["e"], ["left-e"], ["s"], ["left-s"]) and got.rotation.width == 4 and got


def test_the_options_build_the_chain_fold_params_always_ran():
    assert R.from_options() == () and not R.run((), _Recording())
    got = R.from_options(equalize=True, smooth=[[1]], alpha=0.75, rotate=True, seed=5)
    assert got == (R.Rotate(5), R.Equalize(), R.Smooth(([1],), 0.75))
    conv = R.calibrations(got, lambda c: [x * 2 for x in c])
    assert conv[2] == R.Smooth(([1, 1],), 0.75) and conv[:2] == got[:2]
    assert got == R.from_options(equalize=True, smooth=[[1]], alpha=0.75, rotate=True,
                                 seed=5)          # values, compared by what they ask


def _decoder():
    p = examples.init_decoder(2, d=32, vocab=64)
    t = jnp.zeros((2, 8), jnp.int32)
    rng = np.random.default_rng(0)
    calib = [jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32) for _ in range(2)]
    return p, t, calib


def test_equalize_and_smooth_in_one_call_keep_their_own_records_on_both_paths():
    p, t, calib = _decoder()
    out = hlofold.fold_params(examples.decoder_apply, p, t, equalize=True, smooth=calib)
    assert out.equalized and out.smoothed, str(out)
    assert {e.kind for e in out.equalized} == {"equalized"}
    assert {e.kind for e in out.smoothed} == {"smoothed"}
    assert out.not_equalized and out.not_smoothed
    ref = examples.decoder_apply(p, t)
    assert float(jnp.max(jnp.abs(examples.decoder_apply(out.params, t) - ref))) <= \
        1e-5 * float(jnp.max(jnp.abs(ref)))
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: examples.decoder_apply(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, t)
    new, rep, prep = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, equalize=True,
        smooth=[[c] for c in calib])
    assert {e.kind for e in rep.equalized} == {"equalized"}
    assert {e.kind for e in rep.smoothed} == {"smoothed"}
    d = rep.to_dict()
    assert len(d["equalized"]) == len(rep.equalized) and \
        len(d["smoothed"]) == len(rep.smoothed) == len(out.smoothed), str(rep)
    assert all(n["kind"] in KINDS for n in d["not_equalized"] + d["not_smoothed"])
    assert "smoothed: " in str(rep) and "equalized: " in str(rep)


@pytest.mark.parametrize("act, kind", [
    (jax.nn.relu6, "pair-path"),
    (jnp.tanh, "pair-path"),
    (lambda x: x + jnp.roll(x, 1, axis=-1), "pair-readers"),
])
def test_a_layer_left_has_the_same_kind_on_both_paths(act, kind):
    """What the old reasons were (plain words) and now carry: the kind, the same on the
    jaxpr and the StableHLO path, for the layer the activation stops."""
    from tests.quant.jaxpr.test_equalize import mobile
    from tests.quant.stablehlo.test_equalize import _exported
    fn, params = mobile(act=act)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 8, 3)), jnp.float32)
    out = hlofold.fold_params(fn, params, x, equalize=True)
    exp, leaves, _ = _exported(fn, params, x)
    _, rep, _ = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, equalize=True)
    for left in (out.not_equalized, rep.not_equalized):
        assert left and all(n.kind in KINDS for n in left), left
        assert kind in {n.kind for n in left}, left
    assert sorted(n.kind for n in out.not_equalized) == \
        sorted(n.kind for n in rep.not_equalized), (out.not_equalized, rep.not_equalized)


def test_rotation_refusals_have_a_kind():
    p, t, _ = _decoder()
    pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, p)
    out = hlofold.fold_params(examples.decoder_apply, pb, t, rotate=True)
    assert out.rotation.reason and out.rotation.reason.kind == "rotation", out.rotation
    assert "bfloat16" in str(out.rotation)
