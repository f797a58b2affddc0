"""Folded weights written back into the user's own parameter tree: :func:`fold_params`.

The model is traced with its parameters as inputs and planned with their values (the same
planner and rules as :func:`hlofold.fold`). For each folded site whose kernel is a
parameter leaf:

* the kernel leaf gets ``K ⊙ s`` (and ``diag(γ)·K`` for a norm folded forward);
* every parameter the chain read is solved back to an identity the *unchanged* model code
  computes: scales to 1 (``γ = 1``, ``σ² = 1 − ε``), shifts to 0, except one bias slot — the
  layer's own bias when it has one, else the norm's β — which carries ``t``.

A leaf is changed only when every use of it belongs to sites written back (a norm read by a
non-linear consumer, a kernel tied to an embedding, stay as they are, with the reason). A
kernel reached through reshapes, transposes and reversals of its leaf (Keras' depthwise and
transposed convolutions) is written in the leaf's layout.
The result is checked: the model run with the new tree against the original.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hlofold import _compat as C
from hlofold._quant.core.rewrites import from_options, run as run_rewrites
from hlofold._quant.jaxpr.rewrite import JaxprView, calibration_inputs
from .identities import Writer
from hlofold._fold.jaxpr.fold import plan_sites
from hlofold._fold.jaxpr.merge import merge_scope
from hlofold._base.chain_rules import is_extended
from hlofold._fold.jaxpr.nested import inline_all
from hlofold._fold.jaxpr.roles import site_roles
from hlofold._fold.jaxpr.steps import AffineStep
from hlofold._fold.core.stacks import stacked_view
from hlofold._fold.core.rescale import aligned_empty
from hlofold._base.reasons import Reason, reason_kind
from hlofold._base.report import FOLDED, REFUSED, FoldReport
from .folded_params import NOT_WRITTEN, FoldedParams, ParamChange
from hlofold._base.tolerance import compare, eps, random_inputs
from hlofold._fold.jaxpr.accumulation import output_profiles


def fold_params(fn: Callable, params: Any, *args: Any, equalize: bool = False,
                smooth: Any = None, alpha: float | str = 0.5, rotate: bool = False,
                seed: int = 0) -> FoldedParams:
    """Fold the normalizations of ``fn(params, *args)`` into ``params`` itself.

    Returns :class:`FoldedParams`: ``params`` with the same structure, folded kernels and
    biases, and each absorbed BatchNorm/LayerNorm/RMSNorm set to an identity, so the
    *unchanged* ``fn`` computes the same outputs (within rounding: the folded kernel is
    rounded once to its dtype, an identity σ² = 1 − ε to within an ulp) — ready to save
    (Orbax) or to hand to a quantizer. ``args`` are example inputs (shapes and dtypes matter,
    not values). Leaves that are not arrays (Equinox's static fields) are passed through.

    Then, each keeping the same outputs and making the tree quantize better
    (``docs/quantization.md``): ``equalize=True`` equalizes the channels of each pair of
    layers joined by a positively homogeneous path, and of each residual stream's writers
    and readers together (cross-layer equalization; CNNs quantized per tensor);
    ``smooth=[inputs, ...]`` (calibration inputs: each a call's ``args``, or one array)
    moves SmoothQuant's scales ``max|X_j|^α / max|W_j|^(1−α)`` (``alpha``) from the
    activations into the weights (``alpha="search:w4a8"``: each pair's α chosen from the
    calibration rows for that quantization); ``rotate=True`` rotates a pre-norm decoder's
    residual stream by an orthogonal ``Q`` (``seed``; for LayerNorm one keeping the
    all-ones direction). ``equalized``, ``smoothed`` and ``rotation`` say what was done,
    ``not_equalized`` and ``not_smoothed`` why not the rest (each reason with its kind).

    On a JAX that changed an internal this needs (``hlofold._compat``), ``params`` come back
    as they are, with no changes, and the report says which change.
    """
    off = C.disabled("jaxpr")
    if off is None:
        try:
            return _fold_params(fn, params, *args, equalize=equalize, smooth=smooth,
                                alpha=alpha, rotate=rotate, seed=seed)
        except Exception as e:
            off = C.as_compat(e)
            if off is None:
                raise
    return FoldedParams(params, [], FoldReport([], running=f"the original parameters ({off})",
                                               compat=[str(off)]))


def _fold_params(fn: Callable, params: Any, *args: Any, equalize: bool = False,
                 smooth: Any = None, alpha: float | str = 0.5, rotate: bool = False,
                 seed: int = 0) -> FoldedParams:
    inner = C.jit_info(fn)
    fn = inner[0] if inner else fn
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(params)
    is_arr = [isinstance(l, (jax.Array, np.ndarray)) for _, l in leaves_p]
    arr = [l for (_, l), a in zip(leaves_p, is_arr) if a]
    paths = [jax.tree_util.keystr(p) for (p, _), a in zip(leaves_p, is_arr) if a]
    arg_leaves, arg_tree = jax.tree.flatten(args)
    rewrites = from_options(equalize=equalize, rotate=rotate, seed=seed, alpha=alpha,
                            smooth=calibration_inputs(smooth, len(arg_leaves), alpha))

    def rebuild(vals):
        it = iter(vals)
        return treedef.unflatten([next(it) if a else l for (_, l), a in zip(leaves_p, is_arr)])

    def flat(*xs):
        return fn(rebuild(xs[:len(arr)]), *arg_tree.unflatten(xs[len(arr):]))

    closed = jax.make_jaxpr(flat)(*arr, *arg_leaves)
    # the check's program, compiled before any new leaf exists: its compile's memory is not
    # added to theirs (one compile for both runs: a jitted function would compile again where
    # the new leaves' placement is committed and the old ones' is not)
    run = jax.jit(C.jaxpr_as_fun(closed)).lower(*arr, *arg_leaves).compile()
    _release_freed()                  # the compile's working memory
    ref = run(*arr, *arg_leaves)      # the outputs before any change (runs while we plan)
    n = len(arr)
    # kernels no process holds whole are rescaled on their devices (_Writer.site); the
    # vectors a fold reads (statistics, scales, biases) are read on the host
    deferred = {i: a for i, a in enumerate(arr) if isinstance(a, jax.Array)
                and not a.is_fully_addressable and a.ndim >= 2}
    known = [None if i in deferred or is_extended(a) else _host(a) for i, a in enumerate(arr)]
    closed = inline_all(closed)      # (read, not run: a checkpoint's sites are written too)
    scope = plan_sites(closed, known + [None] * len(arg_leaves),
                       paths + [f"args{i}" for i in range(len(arg_leaves))],
                       in_graph="prepared" if deferred else "never")
    writer = Writer(scope, closed.jaxpr.invars[:n], deferred)
    changes, written = [], set()
    for group in _groups(scope):
        got = writer.group(group)
        if isinstance(got, str):
            for site in group:
                for r in (site.record, site.fwd and site.fwd.record):
                    if r is not None:
                        r.status, r.reason = REFUSED, Reason("not-written", NOT_WRITTEN + got)
            continue
        for site, (kernel, bias, identity, front) in zip(group, got):
            written.update(id(r) for r in (site.record, site.fwd and site.fwd.record) if r)
            roles, eps = site_roles(
                [s for s in site.steps + (site.fwd.steps if site.fwd else [])
                 if isinstance(s, AffineStep)], lambda v: scope.producer.get(v, (0, None))[1],
                writer.leaf, scope.value)
            changes.append(ParamChange(
                site.record or site.fwd.record, paths[kernel],
                None if bias is None else paths[bias],
                sorted({paths[i] for i in identity} - {paths[kernel]} -
                       ({paths[bias]} if bias is not None else set())),
                roles={paths[i]: r for i, r in roles.items() if i != kernel}, epsilon=eps,
                front=None if front is None else paths[front]))
    stacked, stack_changes = _write_stacks(scope, closed.jaxpr.invars[:n], paths)
    changes += stack_changes
    writer.assign.update(stacked)
    written |= {id(c.site) for c in changes}     # (a site folded both ways: both records)
    for s in scope.sites:          # folded in a nested body fold_params does not write
        nested = sum(p in ("scan", "while") for p in (s.scope or "").split("/")) > 1
        if (s.status == FOLDED and id(s) not in written) or (
                nested and s.status == REFUSED and reason_kind(s.reason) == "weights-not-known"):
            s.status, s.reason = REFUSED, Reason("not-written", NOT_WRITTEN + (
                f"the site is inside {s.scope}; fold_params writes the program's top level "
                f"and one level of scanned layer stacks (jit calls and checkpoints in them "
                f"read as inlined), not a cond branch, a shard_map, a while loop or a stack "
                f"inside a stack (hlofold.fold folds it in the program)"))
    if {"add", "conv_general_dilated"} <= {e.primitive.name for e in closed.jaxpr.eqns}:
        # sums of parallel branches: merged in programs only (each branch's BN is written)
        merge_scope(scope, "never", "top", scope.sites, write=False)
    _release_freed()                  # what planning and the rescale's chunks left free
    new = list(arr)
    for i in list(writer.assign):          # one leaf at a time: its host copy dropped at once
        new[i] = _like(arr[i], writer.assign.pop(i))
    for site in scope.site_at_end.values():   # (the plan's copies of the folded kernels:
        site.kernel_const = None              # a later rewrite replaces the leaves)
    def place(i, val):           # one leaf at a time: its host copy dropped once placed
        new[i] = _like(arr[i], val)
        return new[i]
    done = run_rewrites(rewrites, JaxprView(
        closed, new, paths, place, _host,
        retrace=lambda xs: inline_all(jax.make_jaxpr(flat)(*arr, *xs))))
    where = {p: i for i, p in enumerate(paths)}
    for c in changes:
        if c.site.layers is None:
            c.absorbed = {p: np.array(known[where[p]]) if known[where[p]] is not None
                          else None for p in [*c.identity, *([c.bias] if c.bias else [])]}
    out = FoldedParams(rebuild(new), changes, FoldReport(scope.sites), done.equalized,
                       done.not_equalized, done.smoothed, done.not_smoothed, done.rotation)
    _check(ref, run(*new, *arg_leaves), closed, lambda: jax.jit(flat)(
        *(_widened(a) for a in arr), *(_widened(a) for a in arg_leaves)))
    if rewrites:
        # a rewrite is checked on inputs of its own too: the example may be degenerate
        # (zeros, as only its shapes and dtypes matter) and hide a rewrite that is wrong
        fresh = fresh_inputs(arg_leaves, seed)
        _check(run(*arr, *fresh), run(*new, *fresh), closed, lambda: jax.jit(flat)(
            *(_widened(a) for a in arr), *(_widened(a) for a in fresh)),
            on="random inputs of the example's shapes")
    del run
    _release_freed()
    return out


def _write_stacks(scope, leaf_vars, paths) -> tuple[dict, list]:
    """Each scanned stack folded per layer (``scope.stacks``) written back into its stacked
    leaves: every layer's body solved as a layer of its own, the per-layer values stacked.
    A group is written only where it is written in every layer, and a stacked leaf only
    where it is read by that scan alone. Returns ``(leaf index -> new stacked value,
    changes)``; refused sites say why."""
    top = {v: i for i, v in enumerate(leaf_vars)}
    assign, changes = {}, []
    for eqn, layers in scope.stacks:
        nc, ncarry, _ = C.scan_layout(eqn)
        at = next(j for j, e in enumerate(scope.jaxpr.eqns) if e is eqn)
        pos = [k for k, a in enumerate(eqn.invars) if k >= nc + ncarry and a in top
               and scope.uses.get(a) == [(at, k)] and not scope.out_uses.get(a)]
        body = layers[0].jaxpr
        lvars = [body.invars[k] for k in pos]
        rows_form = not pos      # the fori_loop form: each layer reads a row of a loop constant
        if rows_form:
            pos = [k for k in range(nc) if eqn.invars[k] in top and
                   scope.uses.get(eqn.invars[k]) == [(at, k)] and
                   not scope.out_uses.get(eqn.invars[k]) and
                   _row_read(layers, body.invars[k]) is not None]
            reads = [_row_read(layers, body.invars[k]) for k in pos]
            lvars = [r[0] for r in reads]
            if len({r[1] for r in reads}) > 1:
                pos, lvars = [], []         # (the leaves' rows read in different orders)
            order = reads[0][1] if reads else None

        def write(only=None):
            out = []
            for ls in layers:
                w = Writer(ls, lvars, {})
                got = [w.group(g) if only is None or g_i in only else None
                       for g_i, g in enumerate(_groups(ls))]
                out.append((w, got))
            return out
        first = write()
        groups0 = _groups(layers[0])
        ok = {g for g in range(len(groups0))
              if all(not isinstance(got[g], str) for _, got in first)}
        per_layer = write(ok) if len(ok) < len(groups0) else first
        if any(isinstance(got[g], str) for _, got in per_layer for g in ok) or \
                len({tuple(sorted(w.assign)) for w, _ in per_layer}) > 1:
            why = "its layers do not write back alike"
            ok = set()
        else:
            why = None
        for g, group in enumerate(groups0):
            if g not in ok:
                reason = why or next(got[g] for _, got in first if isinstance(got[g], str))
                for site in group:
                    for r in (site.record, site.fwd and site.fwd.record):
                        if r is not None:
                            r.status = REFUSED
                            r.reason = Reason("not-written", NOT_WRITTEN + reason)
                continue
            for site, (kernel, bias, identity, front) in zip(group, per_layer[0][1][g]):
                leaf = lambda j: paths[top[eqn.invars[pos[j]]]]      # noqa: E731
                changes.append(ParamChange(
                    site.record or site.fwd.record, leaf(kernel),
                    None if bias is None else leaf(bias),
                    sorted({leaf(j) for j in identity} - {leaf(kernel)} -
                           ({leaf(bias)} if bias is not None else set())),
                    front=None if front is None else leaf(front)))
        if ok:        # stacked layer by layer, each layer's value dropped once copied
            for j in list(per_layer[0][0].assign):
                # (the fori_loop form: layer l's values go to the row it reads)
                rows = order if rows_form and order else range(len(per_layer))
                n_rows = eqn.invars[pos[j]].aval.shape[0] if rows_form else len(per_layer)
                out = stacked_view([w.assign[j] for w, _ in per_layer]) \
                    if list(rows) == list(range(n_rows)) else None   # the kernels
                if out is None:
                    first = np.asarray(per_layer[0][0].assign[j])
                    out = aligned_empty((n_rows,) + first.shape, first.dtype)
                    del first
                    if n_rows > len(per_layer):     # rows no layer reads keep their values
                        out[...] = np.asarray(scope.value(eqn.invars[pos[j]])).reshape(
                            out.shape)
                    for row, (w, _) in zip(rows, per_layer):
                        out[row] = w.assign[j]
                for w, _ in per_layer:
                    del w.assign[j]
                assign[top[eqn.invars[pos[j]]]] = out.reshape(eqn.invars[pos[j]].aval.shape) \
                    if rows_form else out
        for ls in layers:         # the per-layer folded kernels: no longer needed
            for site in ls.site_at_end.values():
                site.kernel_const = None
    return assign, changes


def _row_read(layers, var):
    """The one ``dynamic_slice`` the stack body reads loop constant ``var`` through, where
    each layer reads a row of its own (whole along the other axes: ``params["K"][i]`` at
    the loop's counter; rows no layer reads stay as they are): ``(its output, the row's
    leaf for the write-back; the row each layer reads)``; else None."""
    uses = [e for e in layers[0].jaxpr.eqns if var in e.invars]
    if len(uses) != 1 or uses[0].primitive.name != "dynamic_slice" or \
            uses[0].invars[0] is not var or \
            tuple(uses[0].params["slice_sizes"]) != (1,) + tuple(var.aval.shape[1:]):
        return None
    e = uses[0]
    rows = []
    for ls in layers:
        starts = [ls.value(u) for u in e.invars[1:]]
        if any(x is None for x in starts) or \
                any(int(np.asarray(x)) != 0 for x in starts[1:]):
            return None
        rows.append(int(np.asarray(starts[0])))
    if len(set(rows)) != len(rows) or not all(0 <= r < var.aval.shape[0] for r in rows):
        return None       # (a row read twice, or clamped: not one row per layer)
    return e.outvars[0], tuple(rows)


def _release_freed() -> None:
    """Hand the memory the C allocator keeps after XLA's compile back to the system (glibc's
    ``malloc_trim``; elsewhere nothing), so that the new leaves are not placed on top of it:
    preparing parameters then grows the process by the new leaves and little else."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _groups(scope) -> list[list]:
    """The folded sites, those folding one norm forward (its consumers) as one group: they
    are written back together or not at all (an identity norm needs every consumer folded)."""
    by_top: dict[Any, list] = {}
    groups = []
    for site in sorted(scope.site_at_end.values(), key=lambda s: s.root_idx):
        if site.fwd is None:
            groups.append([site])
            continue
        top = site.eqn.invars[site.fwd.act]
        if top not in by_top:
            by_top[top] = []
            groups.append(by_top[top])
        by_top[top].append(site)
    return groups


def _host(a) -> np.ndarray:
    """A parameter's value on the host (a view where JAX allows one; an array no process
    holds whole gathered: only vectors are read that way)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def _like(old, val):
    """``val`` as a leaf like ``old``: its dtype, shape, and placement (a global array keeps
    its sharding). Nothing is copied that is already so (a kernel rescaled on the host is
    64-byte aligned: placed on the CPU, JAX aliases it)."""
    dt = np.dtype(old.dtype)
    if isinstance(old, jax.Array) and not getattr(old, "committed", True) and \
            old.is_fully_addressable and len(old.sharding.device_set) == 1:
        # an array placed by no one (``jnp`` made it): its replacement too, so that jit
        # places it where the program needs it, as it placed the original (a committed
        # leaf on one device breaks a program whose activations are sharding-constrained)
        return jax.device_put(np.asarray(val).astype(dt, copy=False).reshape(old.shape))
    if isinstance(val, jax.Array) and isinstance(old, jax.Array):
        val = val if val.dtype == dt else val.astype(dt)
        val = val if val.shape == old.shape else val.reshape(old.shape)
        if val.sharding.is_equivalent_to(old.sharding, old.ndim):
            return val                          # rescaled in old's placement
        if old.is_fully_addressable and len(old.sharding.device_set) == 1:
            return jax.device_put(val, old.sharding)
    val = np.asarray(val).astype(dt, copy=False).reshape(old.shape)
    if not isinstance(old, jax.Array):
        return val
    if not old.is_fully_addressable or len(old.sharding.device_set) > 1:
        return jax.make_array_from_callback(old.shape, old.sharding, lambda idx: val[idx])
    return jax.device_put(val, old.sharding)


def _gather(x) -> np.ndarray:
    return _host(x) if isinstance(x, jax.Array) else np.asarray(x)


def _widened(a):
    """``a`` in float32 where it is a float of fewer bits (bfloat16, float16)."""
    dt = getattr(a, "dtype", None)
    return a.astype(jnp.float32) if dt is not None and jnp.issubdtype(dt, jnp.floating) \
        and np.dtype(dt).itemsize < 4 else a


def fresh_inputs(leaves: list, seed: int = 0) -> list:
    """Inputs like ``leaves`` (shape, dtype, placement) drawn by the tolerance model's
    ``random_inputs(signed=True)``; a leaf of an extended dtype (a PRNG key) as given."""
    drawn = [i for i, a in enumerate(leaves) if not is_extended(a)]
    vals = random_inputs([jax.ShapeDtypeStruct(np.shape(leaves[i]),
                                               getattr(leaves[i], "dtype", np.float32))
                          for i in drawn], seed + 0x5EED, signed=True)
    out = list(leaves)
    for i, val in zip(drawn, vals):
        out[i] = _like(leaves[i], val) if isinstance(leaves[i], jax.Array) else val
    return out


def _check(ref, out, closed, wide=None, on: str | None = None) -> None:
    """The new tree's outputs ``out`` within the tolerance model of the original's ``ref``.
    Where the model computes in a float of fewer than 32 bits, the original's own rounding
    can exceed the bound a fold's rounding is held to (both err from the exact result; the
    original's error is not the fold's): an output that fails is compared, by the same
    model, with the same program run from the same values in float32 (``wide()``), and
    passes if the new tree's output is within the bound of that."""
    profiles = output_profiles(closed.jaxpr)
    widened, where = None, "" if on is None else f" on {on}"
    for j, ((acc, depth, compute), r, o) in enumerate(zip(
            profiles, jax.tree.leaves(ref), jax.tree.leaves(out))):
        if not jnp.issubdtype(r.dtype, jnp.floating):
            continue     # (an argmax flips on exact ties within rounding: the floats say)
        c = compare(_gather(r), _gather(o), acc, depth, compute=compute)
        if c.passed:
            continue
        why = c.why
        if wide is not None and eps(r.dtype, compute=compute) > eps(np.float32):
            if widened is None:
                try:                  # (a model that only runs in its own dtype: no second say)
                    widened = jax.tree.leaves(wide())
                except Exception:     # noqa: BLE001
                    widened = []
            if j >= len(widened):
                raise RuntimeError(f"hlofold.fold_params: the folded parameters change the "
                                   f"model's outputs{where} ({why}); please report this")
            t = _gather(widened[j]).astype(np.float64)
            c2 = compare(t.astype(r.dtype), _gather(o), acc, depth, compute=compute)
            if c2.passed:
                continue
            why += f"; from the float32 computation {c2.why}"
        raise RuntimeError(f"hlofold.fold_params: the folded parameters change the "
                           f"model's outputs{where} ({why}); please report this")
