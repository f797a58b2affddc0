"""The decorator's per-call machinery: cache keys of arguments, the per-signature
:class:`Program`, and the steady-state call.

``jax.jit`` checks, in C++, that a call's arguments have the pytree structure and types of a
compiled signature. :class:`Fast` adds what folding needs — the parameter arrays a prepared
program was folded from must be the same objects, not deleted — with as little Python as
CPython allows (``map``/``itemgetter`` loops), so that a steady-state call of a folded
function costs about what ``jax.jit``'s does (``benchmarks/calls.py``, dispatch).
"""
from __future__ import annotations

import dataclasses
import operator
import warnings
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._base.report import FoldReport
from hlofold._base.tolerance import mismatch
from hlofold._fold.jaxpr.accumulation import output_profiles


def explicit_sharding(x):
    """``x``'s sharding when it is part of its type (a mesh with Explicit axes), else None."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding) and \
            jax.sharding.AxisType.Explicit in sh.mesh.axis_types:
        return sh
    return None


def _typed_sharding(sh, ndim: int) -> tuple:
    """A sharding that is part of a type, as a key equal for a concrete array and a tracer
    of that type (their meshes differ, concrete and abstract; specs are padded to rank)."""
    spec = tuple(sh.spec) + (None,) * (ndim - len(sh.spec))
    return (spec, tuple(sh.mesh.axis_names), tuple(sh.mesh.axis_sizes))


def leaf_key(x):
    """Cheap per-call signature of one input: shape, dtype, weak type (or Python type), and
    the sharding where it is part of the type (explicit mesh axes)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or C.is_tracer(x):   # the same key as a concrete array of that type
        a = C.aval_of(x)
        key = (tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
        vma = C.varying_axes(x)           # inside shard_map: the manual axes it varies over
        sh = explicit_sharding(a)
        key = key if sh is None else key + (_typed_sharding(sh, len(a.shape)),)
        return key + (vma,) if vma else key
    key = (x.shape, dtype, bool(getattr(x, "weak_type", False)))
    sh = explicit_sharding(x)
    return key if sh is None else key + (_typed_sharding(sh, len(x.shape)),)


def trace_struct(x):
    """The abstract value ``x`` is traced as: with explicit mesh axes its sharding is part of
    its type, and the traced program (and the jit around it) must keep it; inside
    ``shard_map`` so are the manual axes it varies over (as ``jax.jit`` traces it)."""
    if C.varying_axes(x):        # inside shard_map: traced with its varying manual axes
        return C.aval_of(x)
    st = C.shape_struct(C.aval_of(x))
    sh = None if C.is_tracer(x) else explicit_sharding(x)
    if sh is None:
        return st
    return jax.ShapeDtypeStruct(st.shape, st.dtype, weak_type=st.weak_type, sharding=sh)


def static_key(static: dict) -> tuple:
    """Static arguments by name, type and value (``jax.jit`` tells ``2`` from ``2.0``)."""
    return tuple((k, type(v), v) for k, v in sorted(static.items(), key=lambda kv: kv[0]))


def check_not_deleted(arrays) -> None:
    for a in arrays:
        if isinstance(a, jax.Array) and a.is_deleted():
            raise RuntimeError(f"hlofold: an input array has been deleted or donated "
                               f"(shape={a.shape}, dtype={a.dtype}); jax.jit would raise too")


def frozen_leaf_key(x):
    """Cache key of one frozen value: arrays by identity (jax.Array is immutable; NumPy
    arrays are compared by content on every call, see ``same_contents``), Python scalars
    by type and value."""
    if isinstance(x, (bool, int, float, complex, str, type(None))):
        return (type(x), x)
    check_not_deleted([x])
    return (type(x), id(x))


def same_contents(copies, leaves) -> bool:
    """Whether every frozen NumPy array still holds the values it was folded with."""
    for i, c in copies:
        x = leaves[i]
        if x.shape != c.shape or x.dtype != c.dtype or not np.array_equal(
                x, c, equal_nan=bool(np.issubdtype(c.dtype, np.inexact))):
            return False
    return True


def as_tuple(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


@dataclasses.dataclass
class Fast:
    """The steady-state call, checked with as little Python as ``jax.jit``'s own cache
    needs: the same pytree of positional arguments, the same parameter (and frozen) arrays
    by identity, per-call inputs of the same type."""
    tree: Any
    get_same: Callable             # args leaves -> the parameter (and frozen) leaves
    same_objs: tuple               # ... which must be these objects
    arrays: tuple                  # parameter jax.Arrays (deleted/donated check)
    get_per_call: Callable         # args leaves -> the per-call inputs, in order
    avals: tuple | None            # their abstract values (all jax.Arrays), else None
    refs: tuple                    # weak references to them: a leaf passed again is of the
    # same type (arrays are immutable), its aval not rebuilt (a key array builds it anew,
    # ~15 µs: a model holding PRNG keys pays that per key per call)
    keys: list                     # their leaf_key (other inputs)
    fn: Callable
    prepared: tuple
    out_tree: Any
    single: bool                   # one output leaf, no container
    types: tuple | None = None     # fn has compile options: per-call inputs of these types
    # only (a traced input goes the full path, which inlines fn: a nested jit takes none)
    deleted: Callable = operator.methodcaller("is_deleted")   # array -> whether deleted
    x64: bool = False              # jax_enable_x64 when made: it types NumPy/Python inputs


def make_fast(args: tuple, known: list, frozen: Sequence, per_call: list, fn: Callable,
              prepared: Sequence, out_tree, options: bool = False) -> Fast | None:
    """The checks a steady-state call with these arguments needs: ``known`` (parameters the
    prepared values come from) and ``frozen`` by identity, ``per_call`` inputs by type.
    None where that cannot be decided from the positional leaves (one object in two places,
    NumPy parameters, which are folded on every call)."""
    if not all(isinstance(k, jax.Array) for k in known):
        return None
    if hasattr(fn, "chosen"):     # a measured program (_tune.Tuned): its choice, direct once
        options = True            # made; a traced input goes the full path (inlined there)
        fn = fn.chosen or fn
    a_leaves, tree = jax.tree_util.tree_flatten(args)
    pos: dict[int, int] = {}
    for i, a in enumerate(a_leaves):
        if id(a) in pos:
            return None
        pos[id(a)] = i
    fixed = list(known) + list(frozen)
    if len(fixed) + len(per_call) != len(a_leaves) or \
            any(id(x) not in pos for x in fixed + per_call):
        return None
    avals = tuple(getattr(x, "aval", None) if isinstance(x, jax.Array) else None
                  for x in per_call)
    if any(a is None for a in avals):
        avals = None                # compared by leaf_key instead
    arrays = tuple(x for x in fixed if isinstance(x, jax.Array))
    return Fast(tree, _getter([pos[id(x)] for x in fixed]), tuple(fixed), arrays,
                _getter([pos[id(x)] for x in per_call]), avals, tuple(map(_weak, per_call)),
                [leaf_key(x) for x in per_call], fn, tuple(prepared), out_tree,
                out_tree == jax.tree_util.tree_structure(0),
                tuple(map(type, per_call)) if options else None, _deleted(arrays),
                jax.config.jax_enable_x64)


def _deleted(arrays: tuple) -> Callable:
    """``array -> is_deleted()`` for these arrays: their class's own method where they are
    all of one class (called unbound, it costs a third of a method lookup per array: this
    check runs over every parameter on every call), else a method call."""
    kinds = set(map(type, arrays))
    if len(kinds) == 1:
        method = getattr(kinds.pop(), "is_deleted", None)
        if callable(method):
            return method
    return _is_deleted


MISS = object()


def fast_call(fast: Fast, args: tuple):
    """The steady-state call, or ``MISS`` when any check fails (the full path decides).
    Written for CPython's C-level loops (``map``, ``itemgetter``): it runs on every call."""
    try:       # the structure checked as it is walked: half of flatten + compare
        leaves = fast.tree.flatten_up_to(args)
    except Exception:                # noqa: BLE001 — any mismatch: the full path decides
        return MISS
    if not all(map(is_, fast.get_same(leaves), fast.same_objs)):
        return MISS
    per_call = fast.get_per_call(leaves)
    if not _all_leaves(per_call):    # flatten_up_to stops at the recorded leaves' places
        return MISS
    if fast.avals is None:           # NumPy inputs, Python scalars (typed by x64)
        ok = list(map(leaf_key, per_call)) == fast.keys and \
            jax.config.jax_enable_x64 == fast.x64
    else:                            # the same objects (C loop), else their types
        same = list(map(is_, per_call, map(_call, fast.refs)))
        try:
            ok = all(same) or all(s or x.aval == a
                                  for s, x, a in zip(same, per_call, fast.avals))
        except AttributeError:       # not a jax.Array this time
            ok = False
    if not ok or any(map(fast.deleted, fast.arrays)) or (
            fast.types is not None and not all(map(is_, map(type, per_call), fast.types))):
        return MISS
    outs = fast.fn(*fast.prepared, *per_call)
    return outs[0] if fast.single else _unflatten(fast.out_tree, outs)


def _getter(idx: Sequence[int]) -> Callable:
    """``leaves -> tuple(leaves[i] for i in idx)``, in C."""
    if len(idx) == 1:
        i = idx[0]
        return lambda l: (l[i],)
    return operator.itemgetter(*idx) if idx else (lambda l: ())


def _weak(x) -> Callable:
    """A weak reference to a per-call input (the fast path keeps no input alive); for an
    input that takes none, one to nothing: its type is compared on every call."""
    try:
        return weakref.ref(x)
    except TypeError:
        return _nothing


def _nothing() -> None:
    return None


_call = getattr(operator, "call", None) or (lambda f: f())   # (3.11+: in C)
_is_deleted = operator.methodcaller("is_deleted")
is_, eq = operator.is_, operator.eq
_unflatten, _all_leaves = jax.tree_util.tree_unflatten, jax.tree_util.all_leaves


@dataclasses.dataclass
class Program:
    """One input signature of a ``Folded``: its traced program, where its inputs go, and
    what the calls of that signature have cached and learned."""

    key: Any
    original: C.ClosedJaxpr
    leaf_names: list[str]
    const_names: list
    out_tree: Any
    known_idx: list[int]           # inputs a folded site reads: folded per value, on the host
    unknown_idx: list[int]         # per-call inputs
    executables: Any               # _prepare.Executables
    frozen_refs: tuple = ()        # keeps frozen arrays alive so their ids stay unique
    frozen_copies: tuple = ()      # (index, copy) of frozen NumPy arrays: checked every call
    donated: tuple = ()            # flat input positions donated (from a jitted input)
    options: dict | None = None    # the jitted function's compiler_options: every program
    unfolded: Callable | None = None  # the original program (fail-closed fallback, churn)
    reference: Callable | None = None  # the original program without donation (verify)
    cached: tuple | None = None    # (known leaves, Folding, apply executable, device values)
    verified: bool | None = None   # verify=True: None until the first call compared
    variants: dict = dataclasses.field(default_factory=dict)   # in_graph mode -> (jaxpr, report)
    device: Any = None             # _prepare.DevicePrepare, made on first use
    hits: int = 0                  # calls served by the cached prepared values
    churn: int = 0                 # consecutive re-prepares after fewer than 2 hits
    churned: bool = False          # parameters change every call: run the original program
    compat: str | None = None      # preparing needs an internal this JAX changed: the original

    def original_fn(self) -> Callable:
        """The original program, compiled (fallbacks: verify, churn, a changed JAX)."""
        if self.unfolded is None:
            self.unfolded = jax.jit(C.jaxpr_as_fun(self.original), donate_argnums=self.donated,
                                    compiler_options=self.options)
        return self.unfolded

    def reference_fn(self) -> Callable:
        """The original program, never donating (verify runs it before the folded one)."""
        if not self.donated:
            return self.original_fn()
        if self.reference is None:
            self.reference = jax.jit(C.jaxpr_as_fun(self.original),
                                     compiler_options=self.options)
        return self.reference

    def running(self) -> str | None:
        """What calls of this signature run instead of the folded program, and why."""
        if self.compat:
            return self.compat
        if self.verified is False:
            return ("the original program (verify=True found the folded outputs differ on the "
                    "first call)")
        if self.churned:
            return (f"the original program (the parameters were new arrays on {CHURN_LIMIT} "
                    "calls in a row: preparing each would cost more than the BatchNorm saves; "
                    "pass the same arrays, or use split())")
        return None


# A signature whose parameters were prepared again this many times in a row, each used for
# fewer than two calls, runs the original program from then on: preparing (O(|K|) on the
# host) every call would cost more than the BatchNorm epilogue it saves.
CHURN_LIMIT = 3


def verify_outputs(prog: Program, ref: list, outs: list) -> list:
    """Compare the folded outputs with the original program's on these inputs; on a
    mismatch warn and switch this signature to the original program."""
    profiles = output_profiles(prog.original.jaxpr)
    bad = [(k, why) for k, (r, o) in enumerate(zip(ref, outs))
           if (why := mismatch(r, o, *profiles[k])) is not None]
    prog.verified = not bad
    if not bad:
        return outs
    rep = prog.cached[1].report if prog.cached is not None else FoldReport([])
    sites = ", ".join(f"{s.pattern} at {s.location}" for s in rep.folded)
    k, why = bad[0]
    warnings.warn(
        f"hlofold: verify: the folded program differs from the original on output {k} "
        f"({why}; {len(bad)} of {len(outs)} outputs differ); folded sites: "
        f"{sites or 'none'}; running the original program for this input signature",
        RuntimeWarning, stacklevel=4)
    return ref
