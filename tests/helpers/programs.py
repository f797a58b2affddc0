"""Generated conv networks for the property tests (``tests/fold/jaxpr/test_generated.py``,
``tests/parity/test_differential.py``): hypothesis strategies (:func:`specs`), the program a
spec describes (:func:`build`) and the error bounds the tests hold it to.

Each example is a network of 1–6 conv layers of one rank (1D/2D/3D) with

* random ``dimension_numbers`` (the lhs of the first layer, every rhs and every output are
  random permutations of the letters; later lhs specs follow the tensor they read),
* per-spatial-dim kernel sizes, strides, rhs dilations, SAME/VALID/explicit padding,
  ``feature_group_count``, and transposed convs (lhs dilation with explicit padding),
* float32 or bfloat16 (bf16 nets run the chain in bf16, or cast to float32 and back),
* after each conv a random affine chain: add/sub/``c - y``/mul/div/neg by Python literals,
  0-d arrays, all-unit arrays or per-channel vectors (broadcast by ``broadcast_in_dim``,
  ``reshape``, implicit broadcasting, or computed as ``γ·rsqrt(σ²+ε)``), operands stored in
  another float dtype and cast, transposes inside the chain,
* extra consumers: a residual reading the conv output, a second reader of a mid-chain value
  (another program output, or a reduction),
* an optional per-input-channel affine in front of the first conv (forward folding), and
  layers without a nonlinearity, so one conv's chain feeds the next conv directly,
* layers wrapped in ``jax.jit``, a ``jax.jit`` inside a ``jax.jit`` (nested calls),
  ``jax.checkpoint`` (remat), ``lax.scan`` or ``lax.cond`` (two different branches), or a
  convolution alone in a ``jax.jit`` helper, once or nested (its chain outside),
* parameters frozen (constants), passed as inputs, or mixed.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

from hlofold._base.tolerance import bound as tolerance_bound

SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
BF16 = np.dtype(jnp.bfloat16)
LOW = ("bfloat16", "float16")     # nets checked against a float32 run of the same numbers
AFFINE = ("add", "sub", "rsub", "mul", "div", "neg")
OPERANDS = ("literal", "scalar", "unit", "vec-bid", "vec-reshape", "vec-implicit", "vec-bn",
            "vec-einsum")
TOKEN_OPERANDS = ("token", "token-vec")   # per-token factors: in front of the first conv only


# --------------------------------------------------------------------------- the spec


@dataclasses.dataclass
class Op:
    kind: str                   # AFFINE, or "transpose" / "cast" (pass steps)
    operand: str | None = None  # OPERANDS, TOKEN_OPERANDS
    left: bool = False          # operand on the left (c + y, c * y)
    store: str = "same"         # dtype the operand is stored in: "same", "float32", "float16"
    perm: tuple = ()            # transpose: the permutation


@dataclasses.dataclass
class Chain:
    ops: list
    reader: int | None = None   # value after ops[:reader] has a second reader
    reader_out: bool = False    # ... which is a program output (else a reduction)
    residual: bool = False      # the layer output also adds the conv output
    f32: bool = False           # bf16 nets: run the chain in float32 (cast, ops, cast back)

    def safe(self) -> bool:
        """Whether the backward fold of this chain is safe by construction (and folds)."""
        if self.residual:
            return False
        ops = self.ops if self.reader is None else self.ops[:self.reader]
        aff = [o for o in ops if o.kind in AFFINE and o.kind != "neg"]   # (a sign is no fold)
        if not aff:
            return False
        if len(aff) == 1 and aff[0].kind in ("add", "sub"):
            return False                          # add (either side) / sub: canonical
        # a bf16 kernel whose chain computes in float32 is refused (precision rule)
        return not self.f32


@dataclasses.dataclass
class Layer:
    wrap: str                   # "none", "jit", "jitjit", "remat", "scan", "cond", "jitconv",
    # "jitjitconv" (the conv alone in a helper jitted inside another jitted helper)
    rhs: str                    # rhs layout, e.g. "HWIO"
    out: str                    # output layout
    groups: int
    cout: int
    ksize: dict                 # spatial letter -> kernel size
    stride: dict
    rdil: dict
    ldil: dict
    padding: object             # "SAME", "VALID" or {letter: (lo, hi)}
    chains: list                # one, or two for cond
    act: str                    # "tanh", "relu", "none"
    scan_len: int = 1


@dataclasses.dataclass
class Spec:
    rank: int
    dtype: str                  # "float32" / "bfloat16"
    lhs: str                    # layout of the input
    sizes: dict                 # letter -> size of the input ("N", "C", spatial)
    pre: list                   # affine ops in front of the first conv (forward folding)
    layers: list
    params: str                 # "input", "frozen", "mixed"
    seed: int
    pred: int = 1

    def expected(self) -> int:
        return sum(ch.safe() for layer in self.layers for ch in layer.chains)

    def depth(self) -> int:
        return sum(layer.scan_len for layer in self.layers)


def _out_size(n, k, s, rd, ld, pad):
    nd = (n - 1) * ld + 1
    kd = (k - 1) * rd + 1
    if pad == "SAME":
        return -(-nd // s)
    if pad == "VALID":
        return -(-(nd - kd + 1) // s) if nd >= kd else 0
    lo, hi = pad
    return (nd + lo + hi - kd) // s + 1 if nd + lo + hi >= kd else 0


def _perm(letters: str, draw) -> str:
    return "".join(draw(st.permutations(list(letters))))


@st.composite
def chains(draw, *, rank: int, allow_transpose: bool, bf16: bool):
    n = draw(st.integers(0, 5))
    ops = []
    for _ in range(n):
        kinds = AFFINE + (("transpose",) if allow_transpose else ())
        kind = draw(st.sampled_from(kinds))
        if kind == "transpose":
            ops.append(Op("transpose", perm=tuple(draw(st.permutations(range(rank + 2))))))
        elif kind == "neg":
            ops.append(Op("neg"))
        else:
            ops.append(Op(kind, draw(st.sampled_from(OPERANDS)), left=draw(st.booleans()),
                          store=draw(st.sampled_from(["same", "same", "float32", "float16"]))))
    reader = draw(st.one_of(st.none(), st.none(), st.integers(0, len(ops))))
    return Chain(ops, reader=reader, reader_out=draw(st.booleans()),
                 residual=draw(st.integers(0, 5)) == 0,
                 f32=bf16 and draw(st.booleans()))


@st.composite
def specs(draw, dtypes=("float32",) * 4 + ("bfloat16",), params=("input", "frozen", "mixed")):
    rank = draw(st.integers(1, 3))
    sp = SPATIAL[rank]
    dtype = draw(st.sampled_from(dtypes))
    bf16 = dtype in LOW
    lhs = _perm("NC" + sp, draw)
    smax = {1: 9, 2: 7, 3: 5}[rank]
    sizes = {"N": draw(st.integers(1, 2)), "C": draw(st.integers(1, 6))}
    for c in sp:
        sizes[c] = draw(st.integers(2, smax))
    pre = []
    if draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 2))):
            kind = draw(st.sampled_from(["add", "sub", "mul", "div"]))
            # a per-token factor (RMSNorm's rsqrt of the mean square over the channels),
            # alone or times a per-channel γ: kept in the graph, γ folded
            pre.append(Op(kind, draw(st.sampled_from(
                ["scalar", "vec-bid", "vec-reshape"] +
                (list(TOKEN_OPERANDS) + ["vec-einsum"] if kind == "mul" else []))),
                          left=draw(st.booleans())))
    layers = []
    cur = dict(sizes)
    layout = lhs
    n_layers = draw(st.integers(1, 6 if rank < 3 else 4))
    for _ in range(n_layers):
        wrap = draw(st.sampled_from(["none"] * 5 + ["jit", "remat", "scan", "cond", "jitconv",
                                                    "jitjit", "jitjitconv"]))
        cin = cur["C"]
        groups = draw(st.sampled_from([g for g in range(1, cin + 1) if cin % g == 0]))
        if wrap == "scan":
            cout = cin
        else:
            cout = groups * draw(st.integers(1, max(1, 6 // groups)))
        rhs, out = _perm("OI" + sp, draw), _perm("NC" + sp, draw)
        ksize, stride, rdil, ldil = {}, {}, {}, {}
        transposed = wrap != "scan" and draw(st.integers(0, 4)) == 0
        for c in sp:
            ksize[c] = draw(st.integers(1, 3))
            stride[c] = 1 if wrap == "scan" else draw(st.sampled_from([1, 1, 2]))
            rdil[c] = draw(st.sampled_from([1, 1, 2]))
            ldil[c] = draw(st.sampled_from([1, 2])) if transposed else 1
            if (cur[c] - 1) * ldil[c] + 1 > 12:
                ldil[c] = 1
        if transposed and any((ksize[c] - 1) * rdil[c] + 1 > cur[c] for c in sp):
            # XLA:CPU aborts the process (AlgebraicSimplifier "Window dimensions do not match
            # RHS shape") compiling some lhs-dilated convs whose window is larger than the
            # input, e.g. NHWC x (1, 2, 4, 1), HWIO k (3, 2, 1, 1), lhs_dilation (2, 2),
            # VALID — the unfolded program as well. Those are not generated.
            ldil = {c: 1 for c in sp}
        if wrap == "scan":
            padding = "SAME"
        elif transposed or draw(st.integers(0, 3)) == 0:
            padding = {c: (draw(st.integers(0, ksize[c] - 1)), draw(st.integers(0, ksize[c] - 1)))
                       for c in sp}
        else:
            padding = draw(st.sampled_from(["SAME", "VALID"]))
        new = {}
        for c in sp:
            pad = padding if isinstance(padding, str) else padding[c]
            o = _out_size(cur[c], ksize[c], stride[c], rdil[c], ldil[c], pad)
            if o < 1:              # too small for this window: pad it up to one output
                if padding == "VALID":
                    padding = {d: (0, 0) for d in sp}
                nd, kd = (cur[c] - 1) * ldil[c] + 1, (ksize[c] - 1) * rdil[c] + 1
                lo, hi = padding[c]
                padding[c] = (lo, hi + kd - (nd + lo + hi))
                o = _out_size(cur[c], ksize[c], stride[c], rdil[c], ldil[c], padding[c])
            new[c] = o
        if wrap == "scan":
            out = layout                   # the carry keeps its layout
        n_chains = 2 if wrap == "cond" else 1
        chs = [draw(chains(rank=rank, allow_transpose=wrap not in ("scan", "cond"), bf16=bf16))
               for _ in range(n_chains)]
        if wrap in ("scan", "cond"):
            for ch in chs:
                ch.reader_out = False      # a second reader inside is a reduction
        layers.append(Layer(wrap, rhs, out, groups, cout, ksize, stride, rdil, ldil, padding,
                            chs, draw(st.sampled_from(["tanh", "relu", "none"])),
                            scan_len=draw(st.integers(1, 2)) if wrap == "scan" else 1))
        cur = dict(new, N=cur["N"], C=cout)
        layout = out
        for op in chs[0].ops:
            if op.kind == "transpose":
                layout = "".join(layout[p] for p in op.perm)
    return Spec(rank, dtype, lhs, sizes, pre, layers, draw(st.sampled_from(params)),
                draw(st.integers(0, 2 ** 31 - 1)), pred=draw(st.integers(0, 1)))


# --------------------------------------------------------------------------- the builder

EPS = 1e-5


class _Builder:
    """Turns a Spec into ``(f, args)``: values come from ``spec.seed``, so building twice
    (the net, and for bf16 its float32 reference with ``ref=True``) gives the same numbers."""

    def __init__(self, spec: Spec, ref: bool = False):
        self.spec, self.ref = spec, ref
        self.rng = np.random.default_rng(spec.seed)
        self.bf16 = spec.dtype in LOW
        self.net = np.dtype(np.float32) if ref and self.bf16 else np.dtype(spec.dtype)
        self.inputs: list = []
        self.args: tuple = ()

    def value(self, a, dtype=None):
        a = np.asarray(a, np.float64 if self.spec.dtype == "float64" else np.float32)
        if self.bf16:                       # the net and its reference see the same numbers
            a = a.astype(np.dtype(self.spec.dtype)).astype(np.float32)
        return a.astype(self.net if dtype is None or self.ref else dtype)

    def param(self, a, dtype=None):
        """A parameter: a constant (frozen) or the next program input."""
        a = self.value(a, dtype)
        mode = self.spec.params
        if mode == "frozen" or (mode == "mixed" and self.rng.random() < 0.5):
            return lambda: a
        self.inputs.append(a)
        i = len(self.inputs) - 1
        return lambda: self.args[2 + i]

    # ---- pieces

    def operand(self, op: Op, c: int):
        """A getter for the operand of ``op`` on a chain with ``c`` channels (None: literal)."""
        r = self.rng
        scale = op.kind in ("mul", "div")

        def vals(n):
            if scale:
                return r.choice([-1.0, 1.0], n) * r.uniform(0.5, 2.0, n)
            return 0.5 * r.standard_normal(n)
        store = None if op.store == "same" else np.dtype(op.store)
        if op.operand == "literal":
            v = float(self.value(vals(1))[0])
            return ("literal", v)
        if op.operand == "token":           # computed from the activations only
            return ("token", None)
        if op.operand == "scalar":
            return ("scalar", self.param(vals(1)[0], store))
        if op.operand == "unit":
            return ("unit", self.param(vals(1)[0], store))
        if op.operand == "vec-bn":
            g = r.choice([-1.0, 1.0], c) * r.uniform(0.5, 1.5, c)
            v = r.uniform(0.5, 2.0, c)
            if not scale:                  # as a shift: β − μ·γ/σ-like
                g = 0.5 * r.standard_normal(c)
            return ("vec-bn", (self.param(g, store), self.param(v, store)))
        return (op.operand, self.param(vals(c), store))

    def apply_operand(self, kind_val, y, ca, cdt):
        how, val = kind_val
        if how == "literal":
            return val
        cast = (lambda a: lax.convert_element_type(a, cdt)
                if np.dtype(a.dtype) != np.dtype(cdt) else a)
        nd = y.ndim
        if how == "scalar":
            return cast(val())
        if how == "unit":
            return cast(jnp.reshape(val(), (1,) * nd))
        if how in ("token", "token-vec"):     # rsqrt(mean(y²) over the channels), per token
            ms = jnp.mean(jnp.square(y.astype(jnp.float32)), axis=ca, keepdims=True)
            r = cast(lax.rsqrt(ms + np.float32(EPS)))
            return r if how == "token" else r * self.apply_operand(("vec-bid", val), y, ca,
                                                                    cdt)
        if how == "vec-bn":
            g, v = cast(val[0]()), cast(val[1]())
            p = g * lax.rsqrt(v + np.asarray(EPS, cdt))
            how = "vec-reshape"
        else:
            p = cast(val())
        shape = [1] * nd
        shape[ca] = p.shape[0]
        if how in ("vec-bid", "vec-einsum"):     # (einsum: a product's own spelling)
            return lax.broadcast_in_dim(p, y.shape, (ca,))
        if how == "vec-implicit":
            return p if ca == nd - 1 else jnp.reshape(p, shape[ca:])
        return jnp.reshape(p, shape)

    @staticmethod
    def einsum_product(y, val, ca: int):
        """``y`` times a per-channel vector by ``jnp.einsum`` (a dot contracting nothing,
        then a transpose back)."""
        p = val()
        if np.dtype(p.dtype) != np.dtype(y.dtype):
            p = lax.convert_element_type(p, y.dtype)
        letters = "abcdefgh"[:y.ndim]
        return jnp.einsum(f"{letters},{letters[ca]}->{letters}", y, p)

    @staticmethod
    def affine(op: Op, y, c):
        if op.kind == "neg":
            return -y
        if op.kind == "add":
            return c + y if op.left else y + c
        if op.kind == "sub":
            return y - c
        if op.kind == "rsub":
            return c - y
        if op.kind == "mul":
            return c * y if op.left else y * c
        return y / c

    def chain_fn(self, ch: Chain, c: int):
        """Build-time operands; returns ``run(y, layout) -> (z, layout, aux, outs)``."""
        operands = [None if op.kind in ("neg", "transpose") else self.operand(op, c)
                    for op in ch.ops]
        f32 = ch.f32 and self.bf16 and not self.ref

        def run(y, layout):
            aux = jnp.zeros((), jnp.float32)
            outs = []
            z = y.astype(jnp.float32) if f32 else y

            def read(v):
                nonlocal aux
                if ch.reader_out:
                    outs.append(v)
                else:
                    aux = aux + jnp.max(jnp.abs(v)).astype(jnp.float32)
            for j, (op, operand) in enumerate(zip(ch.ops, operands)):
                if ch.reader == j:
                    read(y if j == 0 else z)
                if op.kind == "transpose":
                    z = jnp.transpose(z, op.perm)
                    layout = "".join(layout[p] for p in op.perm)
                    continue
                if op.kind == "mul" and operand[0] == "vec-einsum":
                    z = self.einsum_product(z, operand[1], layout.index("C"))
                    continue
                c_op = None if operand is None else self.apply_operand(
                    operand, z, layout.index("C"), z.dtype)
                z = self.affine(op, z, c_op)
            if ch.reader == len(ch.ops):
                read(y if not ch.ops else z)
            if f32:
                z = z.astype(self.net)
            return z, layout, aux, outs
        return run

    def layer_fn(self, layer: Layer, lhs: str, cin: int):
        sp = [c for c in layer.rhs if c not in "OI"]
        kshape = [{"O": layer.cout, "I": cin // layer.groups}.get(c) or layer.ksize[c]
                  for c in layer.rhs]
        fan_in = cin // layer.groups * math.prod(layer.ksize.values())
        pad = layer.padding if isinstance(layer.padding, str) else [layer.padding[c] for c in sp]
        kw = dict(window_strides=[layer.stride[c] for c in sp], padding=pad,
                  lhs_dilation=[layer.ldil[c] for c in sp],
                  rhs_dilation=[layer.rdil[c] for c in sp],
                  dimension_numbers=(lhs, layer.rhs, layer.out),
                  feature_group_count=layer.groups)
        branches = []
        for ch in layer.chains:
            k = self.param(self.rng.standard_normal(kshape) / np.sqrt(fan_in))
            branches.append((k, self.chain_fn(ch, layer.cout), ch))
        act = {"tanh": jnp.tanh, "relu": jax.nn.relu, "none": lambda a: a}[layer.act]

        def one(h, branch):
            k, run, ch = branch
            if layer.wrap == "jitconv":        # the conv alone in a jitted helper
                y = jax.jit(lambda h, k: lax.conv_general_dilated(h, k, **kw))(h, k())
            elif layer.wrap == "jitjitconv":   # ... in a helper called by a jitted helper
                conv = jax.jit(lambda h, k: lax.conv_general_dilated(h, k, **kw))
                y = jax.jit(lambda h, k: conv(h, k))(h, k())
            else:
                y = lax.conv_general_dilated(h, k(), **kw)
            z, layout, aux, outs = run(y, layer.out)
            a = act(z)
            if ch.residual:
                r = y
                for op in ch.ops:
                    if op.kind == "transpose":
                        r = jnp.transpose(r, op.perm)
                a = a + r
            return a, layout, aux, outs

        def apply(h):
            if layer.wrap in ("none", "jitconv", "jitjitconv"):
                a, layout, aux, outs = one(h, branches[0])
                return a, layout, aux, outs
            if layer.wrap in ("jit", "jitjit", "remat"):
                box = {}

                def inner(h):
                    a, box["layout"], aux, outs = one(h, branches[0])
                    return a, aux, outs
                wrap = {"jit": jax.jit, "remat": jax.checkpoint,
                        "jitjit": lambda g: jax.jit(lambda h: jax.jit(g)(h))}[layer.wrap]
                a, aux, outs = wrap(inner)(h)
                return a, box["layout"], aux, list(outs)
            if layer.wrap == "cond":
                pred = self.args[1]
                fns = [lambda h, b=b: one(h, b)[:3:2] for b in branches]
                a, aux = lax.cond(pred, fns[0], fns[1], h)
                return a, layer.out, aux, []

            def body(carry, _):
                h, aux = carry
                a, _, aux2, _ = one(h, branches[0])
                return (a, aux + aux2), None
            (a, aux), _ = lax.scan(body, (h, jnp.zeros((), jnp.float32)), None,
                                   length=layer.scan_len)
            return a, lhs, aux, []
        return apply

    def build(self):
        spec = self.spec
        shape = [spec.sizes[c] for c in spec.lhs]
        x = self.value(self.rng.standard_normal(shape))
        pre = [self.operand(op, spec.sizes["C"]) for op in spec.pre]
        fns, lhs, cin = [], spec.lhs, spec.sizes["C"]
        for layer in spec.layers:
            fns.append(self.layer_fn(layer, lhs, cin))
            # the layout after the layer: its output layout, transposed by its chain
            lhs = layer.out
            for op in layer.chains[0].ops:
                if op.kind == "transpose":
                    lhs = "".join(lhs[p] for p in op.perm)
            cin = layer.cout

        def f(*args):
            self.args = args
            h = args[0]
            for op, operand in zip(spec.pre, pre):
                if op.kind == "mul" and operand[0] == "vec-einsum":    # (MaxText's γ)
                    h = self.einsum_product(h, operand[1], spec.lhs.index("C"))
                    continue
                h = self.affine(op, h, self.apply_operand(operand, h, spec.lhs.index("C"),
                                                          h.dtype))
            total = jnp.zeros((), jnp.float32)
            extra = []
            for fn in fns:
                h, _, aux, outs = fn(h)
                total = total + aux
                extra += outs
            return (h, total, *extra)
        return f, [x, np.bool_(spec.pred)] + self.inputs


def build(spec: Spec, ref: bool = False):
    return _Builder(spec, ref).build()


# --------------------------------------------------------------------------- the properties


def accumulation(spec: Spec) -> int:
    """The longest dot product in the net: kernel window × input features per group."""
    longest, cin = 1, spec.sizes["C"]
    for layer in spec.layers:
        longest = max(longest, math.prod(layer.ksize.values()) * (cin // layer.groups))
        cin = layer.cout
    return longest


def bound(spec: Spec, ref, dtype=np.float32) -> float:
    """hlofold's tolerance model (:mod:`hlofold._base.tolerance`) for an output whose reference
    is ``ref``: ``min(eps·(8 + 2·√L)·(D + 1), 1/8)·(max|ref| + 1)`` with ``L`` the longest
    accumulation (kernel window × input features per group) and ``D`` the depth (layers,
    scan iterations counted); ``+ 1`` because activations are O(1) between layers."""
    m = float(np.max(np.abs(np.asarray(ref, np.float64)))) if np.size(ref) else 0.0
    return tolerance_bound(dtype, m + 1.0, accumulation(spec), spec.depth())


def bf16_bound(err_unfolded: float, ref32) -> float:
    """The bfloat16 model: against a float32 run of the same net (same bf16-rounded values),
    the folded program's error is at most twice the unfolded program's plus one bf16 ulp of
    the output scale: ``2·err_unfolded + 2⁻⁸·(max|ref32| + 1)``."""
    m = float(np.max(np.abs(np.asarray(ref32, np.float64)))) if np.size(ref32) else 0.0
    return 2.0 * err_unfolded + 2.0 ** -8 * (m + 1.0)


def err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0
