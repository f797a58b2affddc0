"""Account for the normalizations no root reached.

A BatchNorm after a residual ``add`` (ResNetV2's pre-activation BNs), after a
``concatenate`` (DenseNet) or after a ReLU is a per-channel ``y·s + t`` that no convolution
or dense output reaches through per-channel arithmetic, and whose result does not go straight
into one either: it folds neither backward nor forward. The report still names it, so that
"N normalizations found, M folded" is true. One rule, used by both IR adapters: the adapter
finds each ``multiply`` by a per-channel vector of parameters whose other operand is an
activation and that no site's chain took; :func:`unreached_reason` says why, from the
primitives around it.
"""
from __future__ import annotations

from hlofold._base.reasons import Reason

# why a chain cannot start after these (keyed by the primitive's short name)
_AFTER = {
    "add": "a residual add of two activations: no single convolution owns the sum",
    "concatenate": "a concatenation of several layers' outputs",
    "max": "a non-linearity (ReLU)",
    "min": "a non-linearity (clipping)",
    "maximum": "a non-linearity (ReLU)",
    "minimum": "a non-linearity (clipping)",
    "logistic": "a non-linearity (sigmoid)",
    "tanh": "a non-linearity (tanh)",
    "reduce_max": "a pooling",
    "reduce_window_max": "a max pooling",
    "reduce_window": "a pooling",
    "reduce_window_sum": "an average pooling",
    "pad": "a padding",
    "mul": "a product with an activation (a normalization's per-token factor, a gate)",
    "multiply": "a product with an activation (a normalization's per-token factor, a gate)",
    "input": "the program's (or this scope's) input",
}


def unreached_reason(after: str, then: str | tuple[str, ...]) -> str:
    """Why a per-channel scale after primitive ``after`` folded neither backward nor forward.

    ``then``: where its result goes once the per-channel arithmetic and shape ops after it
    (its own ``+ β``, a reshape, a cast) are passed — a primitive, "output", or the
    primitives of several readers (a block input read by a layer and by the residual add)."""
    desc = _AFTER.get(after, "an op that is not per-channel arithmetic")
    if isinstance(then, tuple) and len(then) > 1:
        to = (f"its result is read by {len(then)} ops ({', '.join(then)}): a layer that "
              f"absorbed it would change what the others read")
    elif isinstance(then, tuple):
        then = then[0]
    if isinstance(then, str):
        to = ("it is a program output" if then == "output" else
              f"its result goes to {then}, not straight into a convolution or dense layer")
    return Reason("unreached", f"per-channel scale after {after} ({desc}); no convolution or "
                  f"dense output reaches it, and {to}")
