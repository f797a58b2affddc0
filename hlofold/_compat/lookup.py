"""The one check every JAX internal hlofold reads goes through, and the tested window.

hlofold reads names JAX keeps private (``jax._src``), a few it keeps public but changes
(``jax.extend``), the parameters of its control-flow primitives, and jaxlib's MLIR bindings.
Each is looked up here, once, at import: a name that is missing (a moved module, a renamed
class) becomes a :class:`Missing` stand-in and a line in :data:`CHANGED`, and only the
*feature* that needs it is off (:func:`disabled`). A stand-in raises :class:`CompatError` when
used, which the front ends catch: the call runs the original program, and the report says
which JAX change switched the fold off. Nothing here raises at import.

Features (what a missing internal switches off):

* ``"jaxpr"``: reading and rebuilding jaxprs — ``fold``, ``fold_jaxpr``, ``lower``,
  ``export``, ``fold_params`` (they run or return the original program);
* ``"source"``: the user's file and line in reports (folds go on without them);
* ``"shard_map"``: folds whose operands vary over different manual mesh axes;
* ``"stablehlo"``: jaxlib's MLIR bindings — ``fold_stablehlo`` and the CLI;
* ``"export"``: writing ``jax.export`` artifacts (``fold_stablehlo`` of an ``Exported``).
"""
from __future__ import annotations

import importlib
import re
import warnings
from typing import Any

import jax

# The JAX releases CI runs the suite on (.ci/run): the oldest and the newest installable
# (0.10.x on Python 3.11, 0.11.0 to 0.12.1 on Python 3.12+).
TESTED = ("0.10.0", "0.12.1")
JAX_VERSION: str = jax.__version__


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a suffix (``rc1``, ``.dev2026``) is dropped."""
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def is_untested(version: str = JAX_VERSION) -> bool:
    """Newer than the newest JAX CI tests (development builds of it included)."""
    v = version_tuple(version)
    newest = version_tuple(TESTED[1])
    return v > newest or (v == newest and bool(re.search(r"dev|rc|a\d|b\d", version)))


UNTESTED: bool = is_untested()


def untested() -> bool:
    """Whether this JAX is newer than the tested window (read at call time)."""
    return UNTESTED


WINDOW = f"jax {TESTED[0]} to {TESTED[1]}"


class CompatError(RuntimeError):
    """A JAX or jaxlib internal hlofold reads is missing or has changed meaning."""

    def __init__(self, what: str, feature: str):
        self.what, self.feature = what, feature
        super().__init__(f"JAX {JAX_VERSION} changed {what}: {_OFF[feature]} on this JAX "
                         f"(hlofold is tested with {WINDOW})")

    def __reduce__(self):           # copies and pickles (a Folded holding one is copied)
        return CompatError, (self.what, self.feature)


_OFF = {
    "jaxpr": "hlofold does not fold jaxprs (calls run the original program)",
    "source": "reports carry no source locations",
    "shard_map": "folds whose operands vary over different manual mesh axes are off",
    "stablehlo": "hlofold does not fold StableHLO (modules are returned as given)",
    "export": "hlofold does not write jax.export artifacts",
}

# name -> (feature, what changed), for every internal found missing or changed
CHANGED: dict[str, tuple[str, str]] = {}
# (feature, paths) of every internal looked up, in order (the tests hide each in turn)
LOOKUPS: list[tuple[str, tuple[str, ...]]] = []


def disabled(feature: str) -> CompatError | None:
    """The error that switched ``feature`` off on this JAX (the first one found), or None."""
    for feat, what in CHANGED.values():
        if feat == feature:
            return CompatError(what, feature)
    return None


def require(feature: str) -> None:
    """Raise the :class:`CompatError` that switched ``feature`` off, if any."""
    err = disabled(feature)
    if err is not None:
        raise err


def mark_changed(name: str, feature: str, what: str) -> None:
    """Record that ``name`` (needed by ``feature``) is missing or changed: ``what`` says how."""
    CHANGED.setdefault(name, (feature, what))


class _MissingMeta(type):
    def __instancecheck__(cls, obj):
        raise cls._error()

    def __call__(cls, *a, **k):
        raise cls._error()

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise cls._error()


class Missing(metaclass=_MissingMeta):
    """Stand-in for an internal JAX no longer has: using it (a call, an attribute,
    ``isinstance``) raises :class:`CompatError`."""

    _name = "?"
    _feature = "jaxpr"

    @classmethod
    def _error(cls) -> CompatError:
        return CompatError(CHANGED.get(cls._name, (cls._feature, cls._name))[1], cls._feature)


def internal(feature: str, *paths: str) -> Any:
    """The object at the first of ``paths`` (``"module:attr.attr"``) that exists; otherwise a
    :class:`Missing` stand-in, recorded in :data:`CHANGED` for ``feature``."""
    LOOKUPS.append((feature, paths))
    for path in paths:
        mod, _, attrs = path.partition(":")
        try:
            obj: Any = importlib.import_module(mod)
            for a in attrs.split(".") if attrs else ():
                obj = getattr(obj, a)
            return obj
        except (ImportError, AttributeError):
            continue
    name = paths[0]
    mark_changed(name, feature, f"{name.replace(':', '.')} (not found)")
    return type(f"Missing[{name}]", (Missing,), {"_name": name, "_feature": feature})


def as_compat(err: Exception, feature: str = "jaxpr") -> CompatError | None:
    """``err``, raised by hlofold's own machinery while folding, as what fails closed: a
    :class:`CompatError` as it is; on a JAX newer than the tested window any other error too
    (hlofold has not seen that JAX: the call runs the original program, the report says why);
    on a tested JAX None — a bug of hlofold's, to raise."""
    if isinstance(err, CompatError):
        return err
    if not UNTESTED:
        return None
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return CompatError(f"what hlofold reads ({type(err).__name__} while folding: {first})",
                       feature)


def warn_untested(stacklevel: int = 2) -> None:
    """Say once, on an untested JAX, what hlofold does there."""
    if untested():
        warnings.warn(
            f"hlofold is tested with {WINDOW}; this is jax {JAX_VERSION}. Folded functions "
            f"verify the first call of each input signature against the original program "
            f"(verify=True is the default here), and a fold that needs a JAX internal that "
            f"changed is off: its calls run the original program and its report says why.",
            RuntimeWarning, stacklevel=stacklevel)
