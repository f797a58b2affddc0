"""The shape arithmetic of a pair's channel (``hlofold._base.channel_axes``), both adapters'
rules: channels split over heads, and repeated over an axis (grouped-query attention)."""
from __future__ import annotations

import numpy as np
import pytest

from hlofold._base.channel_axes import (Mapped, broadcast, permuted, read_by_kernel, reshaped,
                                        settled, through_dot)


def _follow(x, axis, shape_ops):
    """Apply the same ops to an array of channel ids and to the channel's axes: the ids the
    arithmetic says each position holds must be those the array holds."""
    for op, *args in shape_ops:
        if op == "reshape":
            axis = reshaped(x.shape, args[0], axis)
            x = x.reshape(args[0])
        elif op == "broadcast":
            dims, out = args
            axis = broadcast(dims, x.shape, out, axis)
            x = np.broadcast_to(np.expand_dims(x, [d for d in range(len(out))
                                                   if d not in dims]), out)
        elif op == "transpose":
            axis = permuted(args[0], axis)
            x = np.transpose(x, args[0])
        assert not isinstance(axis, str), axis
    return x, axis


@pytest.mark.parametrize("kvh,group", [(2, 2), (1, 4), (4, 1), (2, 3)])
def test_repeated_kv_heads_are_tracked_to_the_merged_heads(kvh, group):
    b, t, hd = 2, 3, 4
    ids = np.broadcast_to(np.arange(kvh * hd), (b, t, kvh * hd))        # (channel per position)
    x, axis = _follow(ids, 2, [("reshape", (b, t, kvh, hd)),
                               ("broadcast", (0, 1, 2, 4), (b, t, kvh, group, hd)),
                               ("reshape", (b, t, kvh * group, hd)),
                               ("transpose", (0, 2, 1, 3)),
                               ("transpose", (0, 2, 1, 3)),
                               ("reshape", (b, t, kvh * group * hd))])
    if group == 1:
        assert axis == 2
        return
    assert isinstance(axis, Mapped) and axis.axes == (2,)
    assert axis.positions() == tuple(x[0, 0])           # each row: its kv head's channel
    assert axis.channels == kvh * hd


def test_a_copy_along_a_batch_axis_settles_to_the_plain_channel():
    """A broadcast of batch-1 activations along a new axis before the channels: the copies
    are outputs of their own; a layer contracting the channels alone reads them plainly."""
    got = broadcast((0, 2), (1, 8), (1, 5, 8), 1)
    assert isinstance(got, Mapped) and settled(got) == 2
    rep = broadcast((0, 1, 2, 4), (2, 3, 2, 4), (2, 3, 2, 2, 4), (2, 3))
    merged = reshaped((2, 3, 2, 2, 4), (2, 3, 4, 4), rep)
    assert isinstance(settled(merged), Mapped)          # a repeat: stays what it is


def test_through_probs_at_v_and_into_the_output_projection():
    rep = Mapped((2, 3), np.repeat(np.arange(8).reshape(2, 1, 4), 2, axis=1).reshape(4, 4))
    # probs (b, h, q, k) @ v (b, k, h, d) -> (b, h, q, d): heads a batch axis
    out = through_dot((4, 4), ((3,), (1,)), ((0, 1), (0, 2)), 1, rep)
    assert isinstance(out, Mapped) and out.axes == (1, 3)
    np.testing.assert_array_equal(out.ids, rep.ids)
    # o (h, d, model) contracting (h, d) of (b, q, h, d)
    assert read_by_kernel(((2, 3), (0, 1)), ((), ()), 3, 0,
                          Mapped((2, 3), rep.ids)) == ((0, 1), 2)
    assert through_dot((4, 4), ((3,), (1,)), ((0, 1), (0, 2)), 1,
                       Mapped((2, 1), rep.ids)) is None     # (contracts a channel axis)


def test_a_reshape_of_repeated_channels_apart_is_refused():
    rep = Mapped((1, 3), np.zeros((2, 4), int))
    assert isinstance(reshaped((2, 2, 3, 4), (2, 2, 12), rep), str)


def test_repeated_channels_with_a_unit_axis_between_them_merge():
    """keras_hub's attention leaves a unit axis between the heads and head_dim before
    merging them: the ids carry it along."""
    ids = np.repeat(np.arange(8).reshape(2, 1, 4), 2, axis=1).reshape(4, 1, 4)
    got = reshaped((3, 4, 1, 4), (3, 16), Mapped((1, 3), ids[:, 0, :]))
    assert isinstance(got, Mapped) and got.axes == (1,)
    assert got.positions() == tuple(ids.ravel())
