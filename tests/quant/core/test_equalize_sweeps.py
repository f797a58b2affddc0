"""The sweeps of :func:`hlofold._quant.core.equalize.equalize` read only each array's ranges, kept
as ``max|k|`` over the axes no scale touches (a kernel's taps), and rescale the arrays once at
the end by each pair's total: the same scales, spreads and new values as sweeping the whole
arrays in place (the rule as written: every sweep's scales applied to float64 copies), over
generated chains of every layout a pair takes — dense, grouped and depthwise second layers,
a channel over two axes (attention heads), rows reading repeated channels (grouped-query
attention), residual writers, biases — and with scales rounded to powers of two."""
from __future__ import annotations

import numpy as np
import pytest

from hlofold._quant.core import equalize as E


def _swept_whole(values, pairs, pow2):
    """The rule on the whole arrays: each sweep's scales applied in place."""
    work = {k: np.array(values[k], np.float64) for p in pairs for k in p.keys()}
    n = [E.channel_max(work[p.first], p.out_axis).size for p in pairs]
    total = [np.ones(c) for c in n]
    for _ in range(E.SWEEPS):
        last = 0.0
        for j, p in enumerate(pairs):
            s = E.scales(*E.ranges(work, p, n[j]), pow2)
            E.apply(work, p, s)
            total[j] = total[j] * s
            last = max(last, float(np.max(np.abs(s - 1.0), initial=0.0)))
        if last < E.SETTLED:
            break
    return work, total


def _program(seed):
    """A random chain of pairs over every layout, its arrays and pairs."""
    rng = np.random.default_rng(seed)
    v, pairs = {}, []

    def kernel(name, shape, out_axis):
        spread = 10 ** rng.uniform(-1, 1, shape[out_axis])
        full = [1] * len(shape)
        full[out_axis] = shape[out_axis]
        v[name] = rng.standard_normal(shape) * spread.reshape(full)

    c = int(rng.choice([4, 6, 8]))
    kernel("k0", (3, 3, 3, c), 3)
    prev, axis = "k0", 3
    for i in range(1, 5):
        kind = rng.choice(["dense", "depthwise", "grouped", "bias"])
        name = f"k{i}"
        if kind == "depthwise":
            kernel(name, (3, 3, 1, c), 3)
            sec = E.Second(name, 2, 3, groups=c)
        elif kind == "grouped":
            kernel(name, (3, 3, c // 2, c), 3)
            sec = E.Second(name, 2, 3, groups=2)
        else:
            kernel(name, (int(rng.choice([1, 3])),) * 2 + (c, c), 3)
            sec = E.Second(name, 2, 3)
        biases = []
        if kind == "bias" or rng.random() < 0.5:
            v[f"b{i}"] = rng.standard_normal(c)
            biases = [(f"b{i}", 0)]
        writers = []
        if rng.random() < 0.4:                    # a residual writer into the same channels
            kernel(f"w{i}", (1, 1, 3, c), 3)
            writers = [(f"w{i}", 3)]
        pairs.append(E.Pair(prev, axis, [sec], biases, writers))
        prev, axis = name, 3
    # attention: a dense with output channels over (heads, head_dim), an output projection
    # reading them; and one reading repeated kv heads (grouped-query attention)
    heads, dh, d = 2, 3, c
    kernel("q", (d, heads, dh), 1)
    kernel("o", (heads, dh, d), 2)
    pairs.append(E.Pair("q", (1, 2), [E.Second("o", (0, 1), 2)]))
    kernel("v", (d, 1, dh), 1)
    kernel("ogqa", (heads, dh, d), 2)
    rows = tuple(int(r % dh) for r in range(heads * dh))        # each query head: kv head 0
    pairs.append(E.Pair("v", (1, 2), [E.Second("ogqa", (0, 1), 2, channels=rows)]))
    return v, pairs


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_sweeps_on_ranges_give_what_sweeping_the_arrays_gives(seed, pow2):
    values, pairs = _program(seed)
    want, total = _swept_whole(values, pairs, pow2)
    got, done = E.equalize(values, pairs, pow2)
    assert sorted(got) == sorted(want)
    for t, d in zip(total, done):
        np.testing.assert_allclose(d.scale, t, rtol=1e-12)
        assert not pow2 or np.array_equal(d.scale, t)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=0)
        assert not pow2 or np.array_equal(got[k], want[k]), k     # (powers of two: exact)
    for p, d in zip(pairs, done):
        assert d.after == pytest.approx(E.spreads(want, p), rel=1e-12)
        assert d.before == pytest.approx(E.spreads(values, p), rel=1e-12)
    assert all(np.array_equal(values[k], _program(seed)[0][k]) for k in values)  # not changed
