"""The kinds of reason a site is refused for, one table for both IR paths.

A reason is written where it is found (in words a user can act on, naming the op and axis);
its *kind* says which rule refused the site, so that the jaxpr and the StableHLO path can be
compared site by site (``tests/test_differential.py``) and reports can be grouped.
``reason_kind(text)`` reads the kind from the text: the first entry of :data:`KINDS` whose
marker occurs in it.
"""
from __future__ import annotations

# (kind, markers): the first kind one of whose markers is in the reason wins
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("not-finite", ("is not finite", "0·inf")),
    ("overflow", ("overflows",)),
    ("underflow", ("underflows",)),
    ("precision", ("would lose accuracy",)),
    ("unchecked-range", ("cannot be checked",)),
    ("weights-not-known", ("not known at transform time", "weights are module arguments",
                           "weights are arguments",
                           "are arguments of")),
    ("kernel-from-activation", ("kernel (rhs) is computed from", "kernel is computed from")),
    ("operand-from-activation", ("operand is computed from",)),
    ("consumers", ("consumers",)),
    ("feature-axis", ("feature_index", "is not the output-feature", "not per-channel",
                      "varies along", "ambiguous")),
    ("not-affine", ("as divisor is not affine",)),
    ("bias-map", ("bias map",)),      # a shift in front of a padded conv (jaxpr path only)
    ("not-float", ("not a float", "integer ")),
)


def reason_kind(reason: str | None) -> str | None:
    """The kind of a refusal reason (None for no reason); ``"other"`` when no entry
    matches."""
    if reason is None:
        return None
    for kind, markers in KINDS:
        if any(m in reason for m in markers):
            return kind
    return "other"
