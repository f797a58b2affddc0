"""Deep models on the StableHLO path (issue 30): every layer folds, nothing recurses.

* A Llama-style decoder (``hlofold.examples``) lowered with its weights as module arguments:
  32 and 96 layers fold every site the jaxpr path folds, in the graph, with ``params=`` and
  with ``split=``, with the original module's outputs; the report accounts for every norm.
  (Before, the StableHLO path stopped folding at about the tenth layer: a bounded ancestry
  walk called every later norm a per-token factor.)
* A chain thousands of ops deep, on both paths (a recursive walk over operands hit Python's
  recursion limit).
* EfficientNet-B0 exported by PyTorch/XLA (checked in, ``make_torch_xla.py``): folds with
  ``params=`` and ``split=`` (it raised ``RecursionError``), and its module computes what
  PyTorch computed.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold import examples
from hlofold._base.reasons import reason_kind
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers import DATA, assert_close
from tests.helpers.torch_weights import weight

TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)


def decoder_module(layers: int, d: int = 16):
    p = examples.init_decoder(layers, d=d, ffn=2 * d, vocab=32)
    text = jax.jit(examples.decoder_apply).lower(p, TOKENS).as_text()
    return p, text


def jaxpr_folds(p) -> int:
    closed = jax.make_jaxpr(examples.decoder_apply)(p, TOKENS)
    return hlofold.fold_jaxpr(closed, in_graph="guarded")[1].num_folded


@pytest.mark.parametrize("layers", [pytest.param(32, marks=pytest.mark.slow), 96])
def test_deep_decoders_fold_every_layer_on_the_stablehlo_path(layers):
    p, text = decoder_module(layers)
    expected = 5 * layers + 1            # q, k, v / gate, up per layer, and the head
    assert jaxpr_folds(p) == expected
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == expected, rep.counts()
    # every norm accounted for: its γ folded into each projection reading it; nothing is
    # reported as a normalization no root reaches
    assert not [s for s in rep.sites if s.status == "not-reached"]
    assert all("per-token factor" in (s.note or "") for s in rep.folded)
    leaves = jax.tree.leaves((p, TOKENS))
    weights = {f"arg{i}": w for i, w in enumerate(leaves[:-1])}
    apply, prep_rep, prepared = hlofold.fold_stablehlo(text, params=weights)
    assert prep_rep.num_folded == expected, prep_rep.counts()
    app, split_rep, prep_mod = hlofold.fold_stablehlo(text, split=[f"arg{len(leaves) - 1}"])
    assert split_rep.num_folded == expected, split_rep.counts()
    if layers == 32:                     # numerics (compiling 96 layers thrice is slow)
        ref = jax.jit(examples.decoder_apply)(p, TOKENS)
        assert_close(ref, module_callable(folded)(*leaves)[0])
        assert_close(ref, module_callable(apply)(TOKENS, *prepared)[0])
        *made, ok = module_callable(prep_mod)(*leaves[:-1])
        assert bool(ok)
        assert_close(ref, module_callable(app)(TOKENS, *made)[0])


def test_projections_of_one_norm_read_one_factor_on_their_kernels():
    """In the graph, the roots reading one norm (Q, K, V; gate, up) with kernels of one type
    multiply them by one broadcast of its γ, written before the first of them: per layer
    two, and one for the head (not one per projection); outputs are the module's."""
    p, text = decoder_module(2)
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == 11, rep.counts()
    main = folded[folded.index("func.func public @main"):]
    gammas = [f"%arg{i}" for i, w in enumerate(jax.tree.leaves(p)) if w.ndim == 1]
    over_kernels = [line for line in main.splitlines() if "stablehlo.broadcast_in_dim" in line
                    and line.split("stablehlo.broadcast_in_dim ")[1].split(",")[0] in gammas
                    and "dims = [0]" in line]
    assert len(over_kernels) == 5, "\n".join(over_kernels)
    assert main.count("stablehlo.is_finite") == 11          # a guard per projection still
    leaves = jax.tree.leaves((p, TOKENS))
    assert_close(jax.jit(examples.decoder_apply)(p, TOKENS), module_callable(folded)(*leaves)[0])


DEPTH = 3000


def deep_chain(x, k, g):
    """A conv followed by 3,000 per-channel adds and multiplies (a chain far deeper than
    Python's recursion limit), by a scale computed from ``g`` through 3,000 ops. Dyadic
    values throughout: every op is exact in float32, so the folded and the original program
    agree to the last bit, whatever order the fold computes in."""
    s = g
    for i in range(DEPTH):
        s = s - 0.25 if i % 2 else s + 0.25
    y = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for i in range(DEPTH):
        y = y * (s / s) if i % 3 == 1 else y * s if i == DEPTH - 1 else y + 2.0 ** -10
    return y


@pytest.mark.slow
def test_a_chain_thousands_of_ops_deep_folds_on_both_paths():
    x = jnp.ones((1, 4, 4, 2))
    k = jnp.asarray([[[[0.5, -0.25, 1.0], [0.125, 0.75, -0.5]]]], jnp.float32)
    g = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)
    ref = np.asarray(jax.jit(deep_chain)(x, k, g))
    f = lambda x: deep_chain(x, k, g)                     # noqa: E731  (constants)
    closed = jax.make_jaxpr(f)(x)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 1, rep.counts()
    np.testing.assert_array_equal(ref, hlofold._compat.jaxpr_as_fun(new)(x)[0])
    folded, srep = hlofold.fold_stablehlo(jax.jit(f).lower(x).as_text())
    assert srep.num_folded == 1, srep.counts()
    assert "stablehlo.multiply" not in folded
    np.testing.assert_array_equal(ref, module_callable(folded)(x)[0])


# ------------------------------------------------------------------ PyTorch/XLA


EFFNET = os.path.join(DATA, "efficientnet_b0_torch_xla.mlir")


def effnet():
    text = open(EFFNET).read()
    names = json.load(open(os.path.join(DATA, "efficientnet_b0_torch_xla.json")))
    specs = hlofold._ir.stablehlo.artifacts.input_specs(text)
    weights = {f"arg{i}": weight(n, sp.shape) for i, (n, sp) in enumerate(zip(names, specs))
               if n != "input"}
    io = np.load(os.path.join(DATA, "efficientnet_b0_torch_xla_io.npz"))
    return text, names, weights, io["x"], io["y"]


def _folded(rep, pattern: str) -> int:
    return sum(s.status == "folded" and s.pattern == pattern for s in rep.sites)


@pytest.mark.slow
def test_efficientnet_from_torch_xla_folds_with_params_and_split():
    text, names, weights, x, y_torch = effnet()
    n_bn = text.count("\"stablehlo.batch_norm_inference\"(")
    full = [weights[f"arg{i}"] if n != "input" else x for i, n in enumerate(names)]
    ref = module_callable(text)(*full)[0]
    assert_close(y_torch, ref)                 # the module computes what PyTorch did
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=weights)
    # every BatchNorm, and each squeeze-excitation's mean scale (÷ H·W, through the reshape
    # in front of its first conv) folded into that conv
    assert _folded(rep, "stablehlo_conv_affine") == n_bn == 49, rep.counts()
    assert _folded(rep, "stablehlo_affine_conv") == 11, rep.counts()
    assert "batch_norm_inference" not in str(apply)
    assert_close(ref, module_callable(apply)(x, *prepared)[0])
    app, srep, prep = hlofold.fold_stablehlo(text, split=[f"arg{names.index('input')}"])
    assert _folded(srep, "stablehlo_conv_affine") == n_bn, srep.counts()
    *made, ok = module_callable(prep)(*[w for w, n in zip(full, names) if n != "input"])
    assert bool(ok)
    assert_close(ref, module_callable(app)(x, *made)[0])
    # folded without the values, the sites stay (weights are arguments), with the reason
    same, rep0 = hlofold.fold_stablehlo(text)
    assert rep0.num_folded == 0 and {reason_kind(s.reason) for s in rep0.sites
                                     if s.status == "refused"} >= {"weights-not-known"}
