"""What the tests share: where the repository and its test data are, numeric closeness and
the structure of folded programs. Shared program builders live beside this module
(``tests.helpers.programs``: generated conv networks; ``tests.helpers.blocks``: transformer
blocks and decoders)."""
from __future__ import annotations

import contextlib
import pathlib

import jax
import numpy as np

import hlofold._compat as C

ROOT = pathlib.Path(__file__).resolve().parents[2]          # the repository
DATA = str(ROOT / "tests" / "testdata" / "stablehlo")          # checked-in StableHLO modules
SCALING = {"mul", "sub", "div", "neg"}


JAX_CONSTS = "jax_use_simplified_jaxpr_constants"


@contextlib.contextmanager
def jax_consts_as_arguments(on: bool):
    """Lowerings in this block with the arrays a function closes over passed as ``@main``
    arguments marked ``jax.const`` (``on``; JAX's default from 0.12.1) or kept in the module
    as constants (before it)."""
    old = getattr(jax.config, JAX_CONSTS)
    jax.config.update(JAX_CONSTS, on)
    try:
        yield
    finally:
        jax.config.update(JAX_CONSTS, old)


def lower_with_constants(jitted, *args):
    """``jitted.lower(*args)`` with the arrays it closes over as constants in the module,
    on every JAX (the module a test means by "weights as constants", as TensorFlow's,
    PyTorch/XLA's and ``jax.export``'s are)."""
    with C.constants_in_module():                 # (hlofold.lower's own context)
        return jitted.lower(*args)


def walk_eqns(closed, fallbacks=False):
    """Every equation of ``closed`` and of every jaxpr nested in it; the fallback branch of
    a folded site's run-time guard (its original equations) only with ``fallbacks``."""
    from hlofold._fold.jaxpr.emit import is_guard
    jaxpr = closed.jaxpr if isinstance(closed, C.ClosedJaxpr) else closed
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        if is_guard(eqn) and not fallbacks:
            yield from walk_eqns(eqn.params["branches"][1])
            continue
        for v in eqn.params.values():
            subs = v if isinstance(v, (tuple, list)) else [v]
            for s in subs:
                if isinstance(s, (C.ClosedJaxpr, C.Jaxpr)):
                    yield from walk_eqns(s, fallbacks)


def conv_consumers(closed, root="conv_general_dilated"):
    """For each root equation, the primitive names of the equations reading its output."""
    out = []
    for eqn, jaxpr in walk_eqns(closed):
        if eqn.primitive.name != root:
            continue
        y = eqn.outvars[0]
        users = [e.primitive.name for e in jaxpr.eqns if any(v is y for v in e.invars)]
        if any(v is y for v in jaxpr.outvars):
            users.append("<output>")
        out.append(users)
    return out


def assert_no_scaling_after_convs(closed, root="conv_general_dilated"):
    cons = conv_consumers(closed, root)
    assert cons, "no convolution found"
    for users in cons:
        assert not (set(users) & SCALING), f"a conv output still feeds {users}"


def primitives(closed) -> list[str]:
    return [e.primitive.name for e, _ in walk_eqns(closed)]


def max_err(ref, out) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    assert ref.shape == out.shape, (ref.shape, out.shape)
    return float(np.max(np.abs(ref - out))) if ref.size else 0.0


def assert_close(ref, out, program=None, *, accumulation=64, depth=2):
    """Every leaf of ``out`` equals ``ref``'s under hlofold's one tolerance model
    (:mod:`hlofold._base.tolerance`): ``(L, D)`` of ``program`` (a closed jaxpr) when given, else
    ``accumulation`` and ``depth`` (defaults: the small nets of the unit tests)."""
    import jax
    from hlofold._base.tolerance import compare
    from hlofold._fold.jaxpr.accumulation import accumulation_of
    if program is not None:
        accumulation, depth = accumulation_of(program.jaxpr)
    refs, outs = jax.tree.leaves(ref), jax.tree.leaves(out)
    assert len(refs) == len(outs), (len(refs), len(outs))
    for k, (r, o) in enumerate(zip(refs, outs)):
        c = compare(np.asarray(r), np.asarray(o), accumulation, depth)
        assert c.passed, f"output {k}: {c.why}"


def fold_jaxpr_checked(f, *args, folds, **options):
    """``fold_jaxpr`` of ``f``'s jaxpr: a valid program, ``folds`` sites folded, the same
    outputs as the original within the model. Returns ``(folded jaxpr, report)``."""
    import jax

    import hlofold
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed, **options)
    C.check_jaxpr(new.jaxpr)
    assert rep.num_folded == folds, str(rep)
    assert_close(jax.jit(C.jaxpr_as_fun(closed))(*args), jax.jit(C.jaxpr_as_fun(new))(*args),
                 closed)
    return new, rep


def fold_checked(f, *args, folds, freeze=(), root=None, refused=None, **options):
    """``hlofold.fold(f, freeze=freeze, **options)``: ``folds`` sites folded (and
    ``refused`` refused, when given), the same outputs as ``f`` on the first call, on a
    cached call and under an enclosing ``jit``, and no scaling left after any ``root``
    equation (when given). Returns ``(folded function, report, f's outputs, folded
    outputs)``."""
    import jax

    import hlofold
    ff = hlofold.fold(f, freeze=freeze, **options)
    rep = ff.report(*args)
    assert rep.num_folded == folds, str(rep)
    if refused is not None:
        assert rep.num_refused == refused, str(rep)
    if root is not None:
        assert_no_scaling_after_convs(ff.jaxpr(*args), root=root)
    program = jax.make_jaxpr(f)(*args)
    ref, out = f(*args), ff(*args)
    assert jax.tree.structure(ref) == jax.tree.structure(out)
    assert_close(ref, out, program)
    assert_close(ref, ff(*args), program)            # cached prepared values
    assert_close(ref, jax.jit(ff)(*args), program)   # under an enclosing transformation
    return ff, rep, ref, out


def unread_ops(text) -> int:
    """How many side-effect-free ops of a StableHLO module nobody reads (nested regions
    included)."""
    from hlofold._ir.stablehlo.module import PURE, parse_module
    module = parse_module(text)
    n = 0

    def visit(op):
        nonlocal n
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    n += inner.name in PURE and all(next(iter(r.uses), None) is None
                                                    for r in inner.results)
                    visit(inner)
    with module.context:
        visit(module.operation)
    return n


def assert_nothing_left_behind(text, folded):
    """The fold of ``text`` left no op nobody reads (the ops a folded site replaced, what
    computed only their operands, and the identities the algebra did not need)."""
    assert unread_ops(folded) <= unread_ops(text), (unread_ops(folded), unread_ops(text))


def fold_both(f, *args, jaxpr_mode="guarded", in_graph=True, run=True):
    """``f`` folded on both paths: ``fold_jaxpr`` of its jaxpr (``in_graph=jaxpr_mode``) and
    ``fold_stablehlo`` of its lowering (``in_graph``). Returns
    ``([(path, report, first output, folded program)], reference output, unchanged)``
    (outputs None without ``run``: a module the CPU cannot run), ``unchanged[path]``: the program is exactly the original (the jaxpr object itself; the
    same module text)."""
    import jax

    import hlofold
    from hlofold._ir.stablehlo.artifacts import module_callable
    from hlofold._ir.stablehlo.module import parse_module
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed, in_graph=jaxpr_mode)
    C.check_jaxpr(new.jaxpr)
    text = lower_with_constants(jax.jit(f, keep_unused=True), *args).as_text()
    folded, srep = hlofold.fold_stablehlo(text, in_graph=in_graph)
    assert_nothing_left_behind(text, folded)
    first = lambda outs: np.asarray(jax.tree.leaves(outs)[0]) if run else None
    ref = first(jax.jit(f)(*args) if run else None)
    # (compiled, as the reference is: evaluated op by op, 0.12.1 differs from it by an ulp)
    outs = [("jaxpr", rep, first(jax.jit(C.jaxpr_as_fun(new))(*args) if run else None), new),
            ("stablehlo", srep, first(module_callable(folded)(*args) if run else None), folded)]
    unchanged = {"jaxpr": new is closed,
                 "stablehlo": str(parse_module(folded)) == str(parse_module(text))}
    return outs, ref, unchanged


def flat_resnet(seed: int = 3):
    """``(f, params, leaves, x)``: the example ResNet-10 (width 8) as a function of its flat
    parameter leaves then the image (``f(*leaves, x)``), as ``jax.export`` of a model with
    weight arguments sees it."""
    import jax
    import jax.numpy as jnp

    from hlofold import examples
    P = examples.init_resnet(10, width=8, seed=seed)
    leaves, tree = jax.tree.flatten(P)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 16, 3)), jnp.float32)

    def f(*a):
        return examples.resnet_apply(jax.tree.unflatten(tree, a[:-1]), a[-1])
    return f, P, leaves, x


def in_threads(work, n: int = 8, interval: float = 1e-6) -> None:
    """``work(k)`` for ``k < n``, each in a thread of its own, started together, with
    CPython switching threads every ``interval`` seconds (interleaving their slow paths)."""
    import sys
    import threading
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def run_on_devices(script: str, n: int = 8, timeout: int = 600):
    """``python -c script`` on ``n`` host CPU devices (set before JAX initializes: a
    subprocess, since this process already runs JAX on one), the repository importable."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n}").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
