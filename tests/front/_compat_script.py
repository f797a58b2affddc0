"""One simulated JAX change, in a process of its own (``tests/front/test_compat.py``).

``python -m tests.front._compat_script '<json>'`` with keys

* ``hide``: internals made to look missing *to hlofold* (JAX itself keeps them):
  ``"module:attr"`` (a renamed or removed name) or ``"module"`` (a moved module);
* ``alias``: ``{"module:attr": "other"}``, the name answering with another (a changed
  meaning: JAX 0.11's ``ClosedJaxpr`` is ``Jaxpr``);
* ``version``: the ``jax.__version__`` hlofold sees at import.

It then uses every entry point on a conv → BatchNorm program and prints one JSON line: the
outputs' largest difference from ``jax.jit``'s, fold counts, the reports' notes, and the
warnings raised.
"""
from __future__ import annotations

import importlib
import json
import sys
import types
import warnings

import jax
import jax.extend.core  # noqa: F401   (JAX loaded whole before anything is hidden)
import jax.extend.mlir  # noqa: F401
import jax.numpy as jnp
import numpy as np


def _proxy(mod: str, hidden: set, aliases: dict):
    real = importlib.import_module(mod)

    class Proxy(types.ModuleType):
        def __getattr__(self, name):
            if name in hidden:
                raise AttributeError(name)
            return getattr(real, aliases.get(name, name))
    return Proxy(mod)


def simulate(cfg: dict) -> None:
    by_mod: dict = {}
    for spec in cfg.get("hide", ()):
        mod, _, attr = spec.partition(":")
        if not attr:
            sys.modules[mod] = None           # import of it fails
        else:
            by_mod.setdefault(mod, (set(), {}))[0].add(attr)
    for spec, other in cfg.get("alias", {}).items():
        mod, _, attr = spec.partition(":")
        by_mod.setdefault(mod, (set(), {}))[1][attr] = other
    for mod, (hidden, aliases) in by_mod.items():
        sys.modules[mod] = _proxy(mod, hidden, aliases)
    if cfg.get("version"):
        jax.__version__ = cfg["version"]


# (tests.helpers imports hlofold: read only once the simulated change is in place)


def net(p, x):
    from tests.helpers.conv_bn import conv_bn
    return jax.nn.relu(conv_bn(p, x))


def looped(p, x):
    """Two steps of a scan whose body reads the parameters as its constants."""
    return jax.lax.scan(lambda h, _: (net(p, h), None), x, None, length=2)[0]


def params(rng, c=4):
    from tests.helpers.conv_bn import conv_bn_params
    return conv_bn_params(rng, c)


def main(cfg: dict) -> dict:
    simulate(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import hlofold
        import hlofold._compat as C
        out: dict = {"changed": {k: list(v) for k, v in C.CHANGED.items()}, "jax": C.JAX_VERSION,
                     "untested": C.untested(), "errors": {}, "diff": {}, "notes": {},
                     "folded": {}}
        rng = np.random.default_rng(0)
        p, x = params(rng), jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)
        ref = np.asarray(jax.jit(net)(p, x))

        def entry(name, run):
            try:
                got, rep = run()
                out["diff"][name] = float(np.max(np.abs(np.asarray(got) - ref)))
                if rep is not None:
                    out["folded"][name] = rep.num_folded
                    out["notes"][name] = [rep.running or ""] + list(rep.compat)
            except Exception as e:          # recorded, for the test to show
                out["errors"][name] = f"{type(e).__name__}: {e}"

        f = hlofold.fold(net)
        entry("fold", lambda: (f(p, x), f.report(p, x)))
        entry("fold again", lambda: (f(p, x), None))            # the steady path
        out["verify_default"] = f._verify
        g = hlofold.fold(jax.jit(lambda p, x, n: net(p, x) * n, static_argnums=2))
        entry("fold(jit, static)", lambda: (g(p, x, 1), g.report(p, x, 1)))
        h = hlofold.fold(net, freeze=0)
        entry("freeze", lambda: (h(p, x), h.report(p, x)))
        entry("under jit", lambda: (jax.jit(f)(p, x), None))
        leaves = jax.tree.leaves((p, x))

        def ins(n):           # the folded program's inputs: x alone, or every leaf (the
            return leaves if n == len(leaves) else [x]   # original, where folding is off

        def run_lowered(low):          # the original's lowering takes (p, x) as given
            if low.in_tree == jax.tree.structure(((p, x), {})):
                return low.compile()(p, x)
            return low.compile()(*ins(low.in_tree.num_leaves))
        entry("jaxpr()", lambda: (jax.extend.core.jaxpr_as_fun(j := f.jaxpr(p, x))(
            *ins(len(j.jaxpr.invars)))[0], None))
        entry("lower()", lambda: (run_lowered(f.lower(p, x)), None))
        entry("split", lambda: ((sp := f.split(p, x)).apply(sp.prepare(p, x), p, x), None))
        closed = jax.make_jaxpr(net)(p, x)
        entry("fold_jaxpr", lambda: _run_jaxpr(hlofold.fold_jaxpr(closed), p, x, C))
        entry("fold_params", lambda: _run_params(hlofold.fold_params(net, p, x), x))
        text = hlofold.lower(net, p, x, freeze=0)
        out["lower_has_rsqrt"] = "rsqrt" in text
        original = jax.jit(lambda x: net(p, x)).lower(x).as_text()
        entry("fold_stablehlo", lambda: _run_text(hlofold.fold_stablehlo(original), original,
                                                  x, p))
        exp = jax.export.export(jax.jit(lambda x: net(p, x)))(x)
        entry("export", lambda: _run_exported(hlofold.fold_stablehlo(exp), exp, x))
        ps = p
        s = hlofold.fold(looped)
        sref = np.asarray(jax.jit(looped)(ps, x))
        try:
            out["scan diff"] = float(np.max(np.abs(np.asarray(s(ps, x)) - sref)))
            srep = s.report(ps, x)
            out["folded"]["scan"] = srep.num_folded
            out["notes"]["scan"] = [srep.running or ""] + srep.compat
        except Exception as e:
            out["errors"]["scan"] = f"{type(e).__name__}: {e}"
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, RuntimeWarning)]
    if cfg.get("demo"):        # the CLI's demo, as a user runs it: its exit code and output
        import contextlib
        import io
        from hlofold._front.cli import main as cli
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                out["demo rc"] = cli(["demo", "--depth", "10", "--width", "8", "--size", "16",
                                      "--batch", "1", "--rounds", "1"])
            except BaseException as e:      # noqa: BLE001 — a traceback is the failure
                out["demo rc"] = f"{type(e).__name__}: {e}"
        out["demo"] = buf.getvalue()
    return out


def _run_jaxpr(result, p, x, C):
    new, rep = result
    if rep.running:                 # nothing folded: the program given, unchanged
        assert rep.num_folded == 0 and new is result[0]
        return jax.jit(net)(p, x), rep
    return C.jaxpr_as_fun(new)(*jax.tree.leaves((p, x)))[0], rep


def _run_params(fp, x):
    return jax.jit(net)(fp.params, x), fp.report


def _run_exported(result, exp, x):
    new, rep = result
    if rep.running:
        assert new is exp and rep.num_folded == 0
    return new.call(x), rep


def _run_text(result, original, x, p):
    text, rep = result
    if rep.running:                 # nothing folded: the module as given
        assert text == original and rep.num_folded == 0
        return jax.jit(net)(p, x), rep
    import hlofold._compat as C
    if C.disabled("export"):        # the runner below writes a jax.export: compare the text
        assert text != original and rep.num_folded == 1
        return jax.jit(net)(p, x), rep
    from hlofold._ir.stablehlo.artifacts import module_callable
    out = module_callable(text, "cpu")(x)
    return (out[0] if isinstance(out, (tuple, list)) else out), rep


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))))
