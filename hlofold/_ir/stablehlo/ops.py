"""What each StableHLO op means to hlofold's walks: the StableHLO registry (facts in
:mod:`hlofold._base.ops`). One entry per op name (``stablehlo.*``, ``chlo.*``, ``sdy.*``,
``func.call``); an op not here has no facts, and every walk stops at it. Add an op here, and
every walk that asks its facts reads it.
"""
from __future__ import annotations

from hlofold._base.ops import Op, Registry

_EW = dict(elementwise=True, pure=True)
_NOT_HOM = dict(elementwise=True, homogeneous=False)

OPS = Registry("stablehlo", {
    # layers
    "stablehlo.convolution": Op(layer="conv", opaque=True, pure=True),
    "stablehlo.dot_general": Op(layer="dot", opaque=True, pure=True),
    "stablehlo.dot": Op(layer="dot", opaque=True),
    # the affine chain
    "stablehlo.add": Op(affine="add", **_EW),
    "stablehlo.subtract": Op(affine="sub", **_EW),
    "stablehlo.multiply": Op(affine="mul", **_EW),
    "stablehlo.divide": Op(affine="div", **_EW),
    "stablehlo.negate": Op(affine="neg", homogeneous=True, **_EW),
    "stablehlo.batch_norm_inference": Op(affine="bn", pure=True),
    # the values as they are, their positions moved
    "stablehlo.convert": Op(shape="cast", rounding="narrowing", **_EW),
    "stablehlo.reshape": Op(shape="reshape", pure=True),
    "stablehlo.broadcast_in_dim": Op(shape="broadcast", pure=True),
    "stablehlo.dynamic_broadcast_in_dim": Op(shape="dynamic_broadcast"),
    "stablehlo.transpose": Op(shape="transpose", pure=True),
    "sdy.sharding_constraint": Op(shape="constraint", homogeneous=True, pure=True),
    # rounding
    "stablehlo.reduce_precision": Op(rounding="always", elementwise=True),
    # elementwise
    "stablehlo.maximum": Op(activation=True, **_EW),   # relu: max(x, 0) (a rule decides)
    "stablehlo.minimum": Op(activation=True, pure=True, **_NOT_HOM),
    "stablehlo.clamp": Op(activation=True, **_NOT_HOM),
    "stablehlo.abs": Op(activation=True, homogeneous=True, elementwise=True),
    "stablehlo.tanh": Op(activation=True, **_NOT_HOM),
    "stablehlo.logistic": Op(activation=True, **_NOT_HOM),
    "stablehlo.exponential": Op(activation=True, **_NOT_HOM),
    "chlo.erf": Op(activation=True, **_NOT_HOM),
    "stablehlo.rsqrt": Op(exponent=-0.5, pure=True, **_NOT_HOM),
    "stablehlo.sqrt": Op(exponent=0.5, pure=True, **_NOT_HOM),
    "chlo.square": Op(exponent=2.0, **_NOT_HOM),
    "stablehlo.power": Op(**_NOT_HOM),
    "stablehlo.cbrt": Op(**_NOT_HOM),
    "stablehlo.log": Op(**_NOT_HOM),
    "stablehlo.log_plus_one": Op(**_NOT_HOM),
    "stablehlo.exponential_minus_one": Op(**_NOT_HOM),
    "stablehlo.sign": Op(**_NOT_HOM),
    "stablehlo.sine": Op(**_NOT_HOM),
    "stablehlo.cosine": Op(**_NOT_HOM),
    # calls whose bodies the walks enter
    "func.call": Op(call="jit"),
    # passes of their own
    "stablehlo.while": Op(opaque=True),
    "stablehlo.if": Op(opaque=True, branches=True),
    "stablehlo.case": Op(opaque=True, branches=True),
    "stablehlo.custom_call": Op(opaque=True),
    "stablehlo.sort": Op(opaque=True),
    # values a fold makes and erases
    "stablehlo.constant": Op(pure=True),
    "stablehlo.reduce_window": Op(pure=True),
    # a stack's rows
    "stablehlo.dynamic_slice": Op(selects=True, pure=True),
    "stablehlo.slice": Op(selects=True, pure=True),
})


def names(where) -> frozenset[str]:
    """The StableHLO ops whose facts satisfy ``where`` (an ``Op`` predicate)."""
    return OPS.names(where)


def of(name: str) -> Op:
    """The facts of the op ``name``."""
    return OPS.of(name)
