"""Issue 40, the fourth adversarial round, on the StableHLO side: composites through ``split=``
and the CLI (item 2). Sharded modules: ``test_shardy.py``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._front import cli as _cli
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers.conv_bn import bn, conv, conv_bn, conv_bn_params


def composite_net(p, x):
    """A BatchNorm written as a ``stablehlo.composite`` (its decomposition a private
    function the module refers to by name, not by ``func.call``) after a conv → BN."""
    y = conv(jax.nn.relu(conv_bn(p, x)), p["k"])
    return jax.lax.composite(bn, name="my.batch_norm")(y, p["mean"], p["var"], p["gamma"],
                                                         p["beta"])


def _case():
    rng = np.random.default_rng(0)
    p = conv_bn_params(rng, 4)
    x = jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)
    return p, x, jax.jit(composite_net).lower(p, x).as_text()


def test_split_keeps_the_functions_composites_refer_to():
    p, x, text = _case()
    assert "stablehlo.composite" in text and "decomposition = @my.batch_norm" in text
    ref = np.asarray(jax.jit(composite_net)(p, x))
    leaves = jax.tree.leaves(p)
    n = len(leaves)
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=[f"arg{n}"])
    assert rep.num_folded == 1                     # the first BN; the composite is the module's
    assert "func.func private @my.batch_norm" in apply
    prepared = module_callable(prepare)(*leaves)
    assert bool(prepared[-1])
    out = module_callable(apply)(x, *prepared[:-1])[0]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # the other modes take it too
    for kw in ({}, {"in_graph": True}):
        folded, rep = hlofold.fold_stablehlo(text, **kw)
        np.testing.assert_allclose(module_callable(folded)(*leaves, x)[0], ref, rtol=1e-5,
                                   atol=1e-5)
    apply, rep, prepared = hlofold.fold_stablehlo(
        text, params={i: np.asarray(v) for i, v in enumerate(leaves)})
    assert rep.num_folded == 1 and "func.func private @my.batch_norm" in apply
    np.testing.assert_allclose(module_callable(apply)(x, *prepared)[0], ref, rtol=1e-5,
                               atol=1e-5)


def test_the_cli_splits_a_module_with_composites(tmp_path, capsys):
    _, _, text = _case()
    src = tmp_path / "m.mlir"
    src.write_text(text)
    code = _cli.main(["fold", str(src), "-o", str(tmp_path / "o.mlir"), "--prepare",
                      str(tmp_path / "p.mlir"), "--per-call", "arg5"])
    assert code == 0 and (tmp_path / "o.mlir").exists() and (tmp_path / "p.mlir").exists()


def test_an_internal_failure_exits_4_with_one_line_and_writes_nothing(tmp_path, capsys,
                                                                     monkeypatch):
    import hlofold._front.artifacts as A
    _, _, text = _case()
    src = tmp_path / "m.mlir"
    src.write_text(text)

    def broken(*a, **k):
        raise IndexError("list index out of range")
    monkeypatch.setattr(A, "fold_stablehlo", broken)
    monkeypatch.delenv("HLOFOLD_TRACEBACK", raising=False)
    out = tmp_path / "o.mlir"
    code = _cli.main(["fold", str(src), "-o", str(out), "--report", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 4 and not out.exists() and not (tmp_path / "r.json").exists()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "internal error (IndexError: list index out of range)" in err and "report" in err
    monkeypatch.setenv("HLOFOLD_TRACEBACK", "1")
    with pytest.raises(IndexError):
        _cli.main(["fold", str(src), "-o", str(out)])
