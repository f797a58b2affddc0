"""Large constants held by reference while a module folds (``_ir/stablehlo/blobs.py``).

The weights bound by ``params=`` and the constants a fold makes are ``dense_resource``
attributes over NumPy arrays inside a fold, plain dense ones in everything that leaves it.
Every path must give exactly what it gives without them (the same text, the same prepared
values), never hand back or change the caller's arrays, and keep each thread's table apart.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._ir.stablehlo import blobs
from tests.fold.jaxpr.test_stacks import CNN, CNN_VARS, X, branch_stack

pytestmark = pytest.mark.skipif(not blobs.ENABLED, reason="no resource attributes here")


def _paths() -> list:
    """``(name, fold, the caller's values)`` for each StableHLO path: weights as constants,
    as arguments bound by ``params=``, as arguments split, scanned stacks."""
    p = examples.init_resnet(10, width=16)
    x = np.random.default_rng(0).standard_normal((2, 16, 16, 3)).astype(np.float32)
    exp = jax.export.export(jax.jit(examples.resnet_apply))(p, x)
    values = {f"arg{i}": np.array(a) for i, a in enumerate(jax.tree.leaves(p))}
    const_text = jax.jit(lambda x: examples.resnet_apply(p, x)).lower(x).as_text()
    arg_text = jax.jit(examples.resnet_apply).lower(p, x).as_text()
    f, sp, sx = branch_stack()
    stack = jax.export.export(jax.jit(f))(sp, sx)
    stack_values = {f"arg{i}": np.array(a) for i, a in enumerate(jax.tree.leaves(sp))}
    scan_text = jax.jit(lambda x: CNN.apply(CNN_VARS, x)).lower(X).as_text()
    n = len(values)
    d = examples.init_decoder(2, d=64)          # its embedding and head stay as they are
    tokens = np.zeros((1, 8), np.int32)
    dec_text = jax.jit(examples.decoder_apply).lower(d, tokens).as_text()
    dec_values = {f"arg{i}": np.array(a) for i, a in enumerate(jax.tree.leaves(d))}
    return [("in the module", lambda: hlofold.fold_stablehlo(const_text), {}),
            ("params=", lambda: hlofold.fold_stablehlo(exp, params=values), values),
            ("params=, text", lambda: hlofold.fold_stablehlo(arg_text, params=values), values),
            ("params=, decoder", lambda: hlofold.fold_stablehlo(dec_text, params=dec_values),
             dec_values),
            ("split=", lambda: hlofold.fold_stablehlo(arg_text, split=[f"arg{n}"]), {}),
            ("stack params=", lambda: hlofold.fold_stablehlo(stack, params=stack_values),
             stack_values),
            ("scanned, in the module", lambda: hlofold.fold_stablehlo(scan_text), {})]


def _result(got) -> tuple:
    """A fold's output as comparable values: module texts, then prepared arrays."""
    texts, arrays = [], []
    for item in got:
        if isinstance(item, list):
            arrays += item
        elif isinstance(item, str):
            texts.append(item)
        elif hasattr(item, "mlir_module"):
            texts.append(item.mlir_module())
    return texts, arrays


def _check(held, plain, given, name):
    (ht, ha), (pt, pa) = held, plain
    assert ht and ht == pt, name
    assert not any("dense_resource" in t for t in ht), name
    assert len(ha) == len(pa) and all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ha, pa)), name
    for v in given.values():                  # the caller's arrays: not handed back
        assert not any(np.shares_memory(a, v) for a in ha), name


def test_every_path_gives_what_it_gives_without_them(monkeypatch):
    paths = _paths()
    copies = {name: {k: v.copy() for k, v in given.items()} for name, _, given in paths}
    monkeypatch.setattr(blobs, "MIN_ELEMENTS", 1)          # every float constant held
    held = [_result(fold()) for _, fold, _ in paths]
    monkeypatch.setattr(blobs, "MIN_ELEMENTS", 1 << 62)    # none
    plain = [_result(fold()) for _, fold, _ in paths]
    for (name, _, given), h, p in zip(paths, held, plain):
        _check(h, p, given, name)
        for k, v in given.items():                         # and not changed
            assert np.array_equal(v, copies[name][k]) and v.flags.writeable, (name, k)


def test_threads_keep_their_tables_apart(monkeypatch):
    """Eight threads folding at once, every constant held: each gets the serial result."""
    paths = _paths()
    monkeypatch.setattr(blobs, "MIN_ELEMENTS", 1)
    serial = [_result(fold()) for _, fold, _ in paths]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: (i % len(paths), _result(paths[i % len(paths)][1]())),
                            range(3 * len(paths))))
    for k, res in got:
        _check(res, serial[k], paths[k][2], paths[k][0])
