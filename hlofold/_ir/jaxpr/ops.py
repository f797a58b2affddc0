"""What each jaxpr primitive means to hlofold's walks: the jaxpr registry (facts in
:mod:`hlofold._base.ops`). One entry per primitive; a primitive not here has no facts, and every
walk stops at it. Add a primitive here, and every walk that asks its facts reads it.
"""
from __future__ import annotations

from hlofold import _compat as C
from hlofold._base.ops import Op, Registry

_EW = dict(elementwise=True)
_NOT_HOM = dict(elementwise=True, homogeneous=False)

OPS = Registry("jaxpr", {
    # layers
    "conv_general_dilated": Op(layer="conv", opaque=True),
    "dot_general": Op(layer="dot", opaque=True),
    # the affine chain
    "add": Op(affine="add", **_EW),
    "sub": Op(affine="sub", **_EW),
    "mul": Op(affine="mul", **_EW),
    "div": Op(affine="div", **_EW),
    "neg": Op(affine="neg", homogeneous=True, **_EW),
    # the values as they are, their positions moved
    "convert_element_type": Op(shape="cast", rounding="narrowing", **_EW),
    "reshape": Op(shape="reshape"),
    "squeeze": Op(shape="squeeze"),
    "expand_dims": Op(shape="expand"),
    "broadcast_in_dim": Op(shape="broadcast"),
    "transpose": Op(shape="transpose"),
    "copy": Op(shape="copy", homogeneous=True, **_EW),
    "copy_p": Op(shape="copy", homogeneous=True, **_EW),
    "name": Op(shape="copy", homogeneous=True, **_EW),     # checkpoint_name: the same values
    "sharding_constraint": Op(shape="constraint", homogeneous=True),
    # rounding
    "reduce_precision": Op(rounding="always", **_EW),
    # elementwise
    "max": Op(activation=True, **_EW),                 # relu: max(x, 0) (a rule decides)
    "min": Op(activation=True, **_NOT_HOM),            # relu6's min(x, 6)
    "clamp": Op(activation=True, **_NOT_HOM),
    "abs": Op(activation=True, homogeneous=True, **_EW),   # |s·x| = s·|x| for s > 0
    "tanh": Op(activation=True, **_NOT_HOM),
    "logistic": Op(activation=True, **_NOT_HOM),
    "exp": Op(activation=True, **_NOT_HOM),
    "erf": Op(activation=True, **_NOT_HOM),
    "rsqrt": Op(exponent=-0.5, **_NOT_HOM),
    "sqrt": Op(exponent=0.5, **_NOT_HOM),
    "square": Op(exponent=2.0, **_NOT_HOM),
    "integer_pow": Op(**_NOT_HOM),
    "pow": Op(**_NOT_HOM),
    "cbrt": Op(**_NOT_HOM),
    "log": Op(**_NOT_HOM),
    "log1p": Op(**_NOT_HOM),
    "expm1": Op(**_NOT_HOM),
    "sign": Op(**_NOT_HOM),
    "sin": Op(**_NOT_HOM),
    "cos": Op(**_NOT_HOM),
    "erf_inv": Op(**_NOT_HOM),
    "reciprocal": Op(**_NOT_HOM),
    "select_n": Op(**_EW),
    "stop_gradient": Op(homogeneous=True, **_EW),
    # calls whose bodies the walks enter (jax.nn's activations are custom_jvp calls)
    **{n: Op(call="jit") for n in C.JIT_NAMES},
    "custom_jvp_call": Op(call="custom", activation=True),
    "custom_vjp_call": Op(call="custom"),
    "custom_vjp_call_jaxpr": Op(call="custom"),
    **{n: Op(call="remat") for n in C.REMAT_NAMES},
    # passes of their own
    "scan": Op(opaque=True),
    "while": Op(opaque=True),
    "cond": Op(opaque=True, branches=True),
    "custom_call": Op(opaque=True),
    "sort": Op(opaque=True),
    # a stack's rows
    "dynamic_slice": Op(selects=True),
    "slice": Op(selects=True),
})


def names(where) -> frozenset[str]:
    """The jaxpr primitives whose facts satisfy ``where`` (an ``Op`` predicate)."""
    return OPS.names(where)


def of(name: str) -> Op:
    """The facts of the primitive ``name``."""
    return OPS.of(name)
