"""Regression tests: minimal programs for bugs found by the generated-program suite
(tests/fold/jaxpr/test_generated.py). Each test names the property that failed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
import hlofold._compat as C
from tests.helpers import assert_close, conv_consumers, primitives

RNG = np.random.default_rng(11)
DN = ("NHWC", "HWIO", "NHWC")


def arr(*shape, lo=None):
    a = RNG.standard_normal(shape).astype(np.float32)
    return jnp.asarray(np.abs(a) + lo if lo is not None else a)


def conv(x, k, padding="VALID"):
    return lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=DN)


def fold_twice(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed, in_graph="prepared")   # structure without guards
    C.check_jaxpr(new.jaxpr)
    assert_close(C.jaxpr_as_fun(closed)(*args), C.jaxpr_as_fun(new)(*args))
    again, rep2 = hlofold.fold_jaxpr(new)
    assert again is new and rep2.num_folded == 0, str(rep2)
    return new, rep


def test_bn_chain_feeding_a_valid_conv_is_folded_once():
    """Found as `check_jaxpr` failing ("Variable not defined"): the chain between two convs
    was taken twice — backward into the first conv and forward into the second (VALID) —
    and the second conv read the first conv's output, which the fold had removed."""
    x, k1, k2 = arr(2, 6, 6, 4), arr(1, 1, 4, 4), arr(1, 1, 4, 5)
    s, t = arr(4, lo=0.5), arr(4)

    def f(x, k1, k2, s, t):
        return conv(conv(x, k1) * s + t, k2)

    for frozen in (False, True):
        g, args = (lambda x: f(x, k1, k2, s, t), (x,)) if frozen else (f, (x, k1, k2, s, t))
        new, rep = fold_twice(g, *args)
        (site,) = rep.folded
        assert site.pattern == "conv_affine" and site.absorbed == ["mul", "add"]
        assert primitives(new).count("conv_general_dilated") == 2


def test_input_affine_then_conv_bias_folds_to_one_bias():
    """Found as a failed idempotence check: ``conv((x − m)/σ, K) + b`` folded forward into
    ``conv(x, K') + b' + b``, and a second fold merged the two biases."""
    x, k = arr(2, 8, 8, 4), arr(3, 3, 4, 6)
    m, sd, b = arr(4), arr(4, lo=0.5), arr(6)

    def f(x, k, m, sd, b):
        return conv((x - m) / sd, k) + b

    for frozen in (False, True):
        g, args = (lambda x: f(x, k, m, sd, b), (x,)) if frozen else (f, (x, k, m, sd, b))
        new, rep = fold_twice(g, *args)
        assert [s.pattern for s in rep.folded] == ["affine_conv"]
        assert conv_consumers(new) == [["add"]]         # one bias left, after the conv
        (add,) = [e for e in new.jaxpr.eqns if e.outvars[0] is new.jaxpr.outvars[0]]
        assert add.primitive.name == "add"


def test_bias_between_two_convs_stays_with_the_first():
    """A conv + bias is canonical; the bias belongs to that conv. Taking it forward into a
    following VALID conv would make the fold of a fold (``conv·s + t`` → ``conv' + t`` →
    ``conv'' + b``) differ from the fold."""
    x, k1, k2, t = arr(2, 6, 6, 4), arr(1, 1, 4, 4), arr(3, 3, 4, 5), arr(4)

    def f(x, k1, k2, t):
        return conv(conv(x, k1) + t, k2)

    closed = jax.make_jaxpr(f)(x, k1, k2, t)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.num_folded == 0
    assert [s.status for s in rep.sites] == ["canonical", "no-pattern"]


def test_chain_through_with_sharding_constraint():
    """Found by the sharding checks (tests/_sharding_script.py): a constraint between the
    conv and its BN ended the chain ("chain ends at sharding_constraint"). It is passed
    through and replayed on the folded conv's output."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x, k, s, t = arr(2, 6, 6, 4), arr(3, 3, 4, 5), arr(5, lo=0.5), arr(5)

    def f(x, k, s, t):
        y = lax.with_sharding_constraint(conv(x, k, "SAME"), NamedSharding(mesh, P("data")))
        return y * s + t

    new, rep = fold_twice(f, x, k, s, t)
    assert rep.num_folded == 1 and rep.folded[0].absorbed == ["sharding_constraint", "mul",
                                                              "add"]
    assert primitives(new).count("sharding_constraint") == 1
    assert conv_consumers(new) == [["sharding_constraint"]]


def test_fp16_channel_underflow_is_refused():
    """Found by the hostile-number tests (tests/fold/jaxpr/test_hostile.py): a tiny BN scale on one
    channel of an fp16 net made K·s flush to zero, silently zeroing a channel whose unfolded
    values (conv·s) are normal fp16 numbers. Frozen, the fold is now refused."""
    x = (1e3 * RNG.standard_normal((1, 4, 4, 2))).astype(np.float16)
    k = (1e-4 * RNG.standard_normal((3, 3, 2, 2))).astype(np.float16)
    s = np.array([1e-4, 1.0], np.float16)
    f = lambda x: conv(x, k) * s
    closed = jax.make_jaxpr(f)(x)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.num_folded == 0
    assert "underflows float16 in 1 output channel(s) (first: [0])" in rep.sites[0].reason
    # ordinary rounding is never flagged: a moderate scale folds
    g = lambda x: conv(x, k) * np.array([0.5, 3.0], np.float16)
    assert hlofold.fold_jaxpr(jax.make_jaxpr(g)(x))[1].num_folded == 1


def test_underflow_is_found_past_the_first_block_and_kernel_zeros_are_not_underflow():
    """The range check reads a rescaled kernel in blocks of 65,536 elements (no temporary as
    large as the kernel): an underflowing channel whose nonzero entries all lie past the
    first block is refused; exact zeros of the kernel (pruned weights) stay zero and do
    not count as underflow."""
    x = RNG.standard_normal((1, 5, 5, 128)).astype(np.float16)
    k = (1e-4 * RNG.standard_normal((3, 3, 128, 64))).astype(np.float16)
    k.reshape(-1)[:70_000] = 0        # 73,728 entries: channel 0 is nonzero only at the end
    tiny = np.ones(64, np.float16)
    tiny[0] = 1e-4
    closed = jax.make_jaxpr(lambda x: conv(x, k) * tiny)(x)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.num_folded == 0
    assert "underflows float16 in 1 output channel(s) (first: [0])" in rep.sites[0].reason
    f = lambda x: conv(x, k) * np.linspace(0.5, 2, 64).astype(np.float16)
    closed = jax.make_jaxpr(f)(x)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 1, str(rep)
    assert "mul" not in primitives(new)
    assert_close(f(x), C.jaxpr_as_fun(new)(x)[0])


@pytest.mark.parametrize("wrap", ["jit", "custom_jvp"])
def test_new_parameter_values_refold_a_site_inside_a_nested_call(wrap):
    """A site folded inside a nested call (an inner ``jax.jit``, a ``custom_jvp``) whose chain
    stays inside it: its folded kernel was a constant of the call's body, which the apply
    program's structure key did not see — a second parameter set ran the first one's folded
    kernel (max|Δ| 4.0). Now a jit body's constants are hoisted (same program, new values)
    and any body's constants are part of the key."""
    def block(p, x):
        y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.tanh(y * p["s"])
    if wrap == "jit":
        inner = jax.jit(block)
    else:
        inner = jax.custom_jvp(block)
        inner.defjvp(lambda primals, tangents: (inner(*primals), tangents[1]))

    def f(p, x):
        return inner(p, x) * 2

    def params(seed):
        r = np.random.default_rng(seed)
        return {"k": jnp.asarray(r.standard_normal((3, 3, 4, 4)), jnp.float32),
                "s": jnp.asarray(r.uniform(0.5, 2, (4,)), jnp.float32)}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 5, 4)), jnp.float32)
    ff = hlofold.fold(jax.jit(f), fold_costly=True)
    for seed in (1, 2, 1, 3):
        p = params(seed)
        assert_close(f(p, x), ff(p, x))
    assert ff.report(p, x).num_folded == 1
    if wrap == "jit":      # one apply program for every parameter set
        prog = next(iter(ff._programs.values()))
        assert len(prog.executables._entries) == 1
