"""The fold report: one record per candidate site, printable and JSON-ready."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

# Site statuses.
FOLDED = "folded"
REFUSED = "refused"          # a chain was there but could not be folded safely
CANONICAL = "canonical"      # already conv + bias: nothing to gain
NO_PATTERN = "no-pattern"    # the conv is not followed by per-channel affine arithmetic
NOT_REACHED = "not-reached"  # a per-channel scale (a normalization) that no root reaches
LEFT = "left"                # safe to fold, left by hlofold.fold's cost rule (_fold.core.cost)
MERGED = "merged"            # parallel branches summed, merged into one convolution


@dataclasses.dataclass
class FoldSite:
    """What happened at one convolution (or other root) of the program."""

    pattern: str                      # name of the pattern that examined the site
    primitive: str                    # root primitive, e.g. "conv_general_dilated"
    status: str                       # FOLDED / REFUSED / CANONICAL / NO_PATTERN / NOT_REACHED / LEFT / MERGED
    scope: str                        # where in the program: "top", "top/jit(apply)/scan", ...
    file: str | None = None
    line: int | None = None
    function: str | None = None
    name_stack: str = ""
    layout: str = ""                  # e.g. "NHWC,HWIO->NHWC"
    in_channels: int | None = None
    out_channels: int | None = None
    groups: int = 1
    dtype: str = ""
    absorbed: list[str] = dataclasses.field(default_factory=list)   # e.g. ["sub", "mul", "add"]
    rescale: str | None = None        # "constant" (at transform time) or "in-graph" (input params)
    guarded: bool = False             # in-graph: checked at run time, original ops as fallback
    params: list[str] = dataclasses.field(default_factory=list)     # pytree paths of absorbed operands
    kernel: str | None = None         # pytree path of the kernel, when it is an input
    reason: str | None = None         # why not folded
    note: str | None = None           # for folded sites: where and why the chain stopped
    cost: dict | None = None          # the cost rule's figures (_fold.core.cost.SiteCost), where asked
    layers: int | None = None         # in a scanned layer stack: its length (one record, every layer)

    @property
    def location(self) -> str:
        if self.file is None:
            return "<unknown>"
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["location"] = self.location
        return d


@dataclasses.dataclass
class FoldReport:
    """Every candidate site of a folded program, with counts.

    ``str(report)`` is a table for people; ``to_dict()``/``to_json()`` are for tools.
    """

    sites: list[FoldSite] = dataclasses.field(default_factory=list)
    precision: dict | None = None     # set by Folded.measure_precision (low-precision nets)
    # None: calls run the program this report describes; else what they run instead and why
    # (hlofold.fold falls back to the original program after a verify mismatch, or when the
    # parameters change on every call)
    running: str | None = None
    # what this JAX changed that kept hlofold from folding part of the program (a body it
    # could not enter, a feature switched off): hlofold._compat says which internal and how
    compat: list[str] = dataclasses.field(default_factory=list)
    # compile options hlofold added to the user's for the program this report describes
    # (merged branches on XLA:CPU: _prepare.compile_options)
    compile_options: dict = dataclasses.field(default_factory=dict)
    # how they were chosen (measured on the first call: hlofold._front.tune), where there was a choice
    compile_note: str | None = None
    # fold_stablehlo(..., equalize=True): the layer pairs equalized after the fold, the
    # layers left as they are, why (hlofold._quant.core.equalize's records); smooth=: the
    # same for smoothing
    equalized: list = dataclasses.field(default_factory=list)
    not_equalized: list = dataclasses.field(default_factory=list)
    smoothed: list = dataclasses.field(default_factory=list)
    not_smoothed: list = dataclasses.field(default_factory=list)

    @property
    def folded(self) -> list[FoldSite]:
        return [s for s in self.sites if s.status == FOLDED]

    @property
    def refused(self) -> list[FoldSite]:
        return [s for s in self.sites if s.status == REFUSED]

    @property
    def merged(self) -> list[FoldSite]:
        return [s for s in self.sites if s.status == MERGED]

    @property
    def num_folded(self) -> int:
        return len(self.folded)

    @property
    def num_refused(self) -> int:
        return len(self.refused)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.status] = out.get(s.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"num_folded": self.num_folded, "num_refused": self.num_refused,
                "counts": self.counts(), "precision": self.precision,
                "running": self.running, "compat": list(self.compat),
                "compile_options": dict(self.compile_options),
                "compile_note": self.compile_note,
                "equalized": [dataclasses.asdict(e) for e in self.equalized],
                "not_equalized": [dataclasses.asdict(e) for e in self.not_equalized],
                "smoothed": [dataclasses.asdict(e) for e in self.smoothed],
                "not_smoothed": [dataclasses.asdict(e) for e in self.not_smoothed],
                "sites": [s.to_dict() for s in self.sites]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        c = self.counts()
        head = (f"hlofold: {c.get(FOLDED, 0)} folded, {c.get(REFUSED, 0)} refused, "
                f"{c.get(CANONICAL, 0)} already conv+bias, {c.get(NO_PATTERN, 0)} without a pattern"
                + (f", {c[NOT_REACHED]} normalizations no conv/dense reaches"
                   if c.get(NOT_REACHED) else "")
                + (f", {c[LEFT]} left for cost" if c.get(LEFT) else "")
                + (f", {c[MERGED]} branch sums merged" if c.get(MERGED) else "")
                + f" ({len(self.sites)} sites)")
        if self.running:
            head += f"\nNOTE: calls run {self.running}"
        for why in self.compat:
            if not (self.running and why in self.running):
                head += f"\nNOTE: {why}"
        for k, v in self.compile_options.items():
            head += f"\nNOTE: compiled with {k}={v}"
        if self.compile_note:
            head += f"\nNOTE: {self.compile_note}"
        for what, done, left in (("equalized", self.equalized, self.not_equalized),
                                 ("smoothed", self.smoothed, self.not_smoothed)):
            if not (done or left):
                continue
            head += f"\n{what}: {len(done)} layer pairs; {len(left)} layers left as they are"
            for e in done:
                head += (f"\n  {e.first} -> {', '.join(e.seconds)} ({e.location}): spread "
                         f"{e.spread_before[0]:.3g} -> {e.spread_after[0]:.3g}" +
                         (f"; a residual stream, written by {', '.join(e.writers)} too"
                          if e.writers else "") +
                         ("; scales powers of two (low-precision: exact)"
                          if e.powers_of_two else "") + e.unsettled())
            for n in left:
                head += f"\n  left ({n.kind}): {n.kernel} ({n.location}): {n.reason}"
        p = self.precision
        if p and p.get("reference"):
            head += (f"\nprecision vs a float32 reference: unfolded max|Δ| "
                     f"{p['max_abs_err_unfolded']:.3g} ({p['rel_err_unfolded']:.2e} rel), "
                     f"folded {p['max_abs_err_folded']:.3g} ({p['rel_err_folded']:.2e} rel), "
                     f"ratio {p['ratio']:.2f}")
        if not self.sites:
            return head
        return head + "\n" + _table(self.sites)

    __repr__ = __str__


# widths of the printed table's columns (longer values keep their informative end)
_WIDTH = {"layout": 22, "layer": 36, "location": 24, "note": 100}


def layer_name(site: FoldSite) -> str:
    """The layer a site belongs to, for people: its name stack without JAX's transform
    wrappers (``jit(f)/``, ``pjit``) — a Keras layer name, a Flax module path, a Haiku module
    name, a TF/torch_xla op name — else the kernel's pytree path (Flax NNX pushes no
    names)."""
    parts = [p for p in site.name_stack.split("/")
             if p and not (p.endswith(")") and "(" in p) and p not in ("pjit", "jit")]
    if parts:
        return "/".join(parts)
    if site.kernel:
        return site.kernel.removesuffix(".value")
    return ""


def _clip(text: str, width: int, keep_end: bool = True) -> str:
    if len(text) <= width:
        return text
    return ("…" + text[-(width - 1):]) if keep_end else (text[:width - 1] + "…")


def _table(sites: list[FoldSite]) -> str:
    """One row per site, widths bounded; a reason shared by several sites (or too long for
    the row) is printed once, in full, below the table, and referred to by a letter."""
    reasons: dict[str, list[int]] = {}
    for i, s in enumerate(sites):
        if s.reason:
            reasons.setdefault(s.reason, []).append(i)
    shared = {r: _key(n) for n, r in enumerate(
        r for r, ix in reasons.items() if len(ix) > 1 or len(r) > _WIDTH["note"])}
    rows = [("#", "status", "op", "layout", "ch", "absorbed", "rescale", "layer", "location",
             "note")]
    for i, s in enumerate(sites):
        ch = "" if s.out_channels is None else (
            (f"{s.in_channels}->" if s.in_channels is not None else "") +
            f"{s.out_channels}" + (f" g{s.groups}" if s.groups != 1 else ""))
        loc = s.location if s.file is None else f"{s.file.rsplit('/', 1)[-1]}:{s.line}"
        if s.reason in shared:
            note = f"({shared[s.reason]})"
        else:
            note = _clip(s.reason or _compact(s.params) or (s.note or ""), _WIDTH["note"], False)
        rows.append((str(i), s.status, _short(s.primitive) + (f"×{s.layers}" if s.layers else ""),
                     _clip(s.layout, _WIDTH["layout"], False), ch, "·".join(s.absorbed),
                     (s.rescale or "") + ("+guard" if s.guarded else ""),
                     _clip(layer_name(s), _WIDTH["layer"]), _clip(loc, _WIDTH["location"]),
                     note))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]
             for r in rows]
    for r, key in shared.items():
        n = len(reasons[r])
        lines.append(f"({key}) {n} site{'s' if n > 1 else ''}: {r}")
    return "\n".join(lines)


def _key(n: int) -> str:
    """a, b, ..., z, aa, ab, ..."""
    return _key(n // 26 - 1) + chr(97 + n % 26) if n >= 26 else chr(97 + n)


def _compact(names: list[str]) -> str:
    """``a['bn']['mean'], a['bn']['var']`` -> ``a['bn'][mean|var]``."""
    if not names:
        return ""
    if len(names) == 1:
        return names[0]
    heads = [n.rsplit("[", 1) for n in names]
    if all(len(h) == 2 for h in heads) and len({h[0] for h in heads}) == 1:
        tails = "|".join(h[1].rstrip("]").strip("'\"") for h in heads)
        return f"{heads[0][0]}[{tails}]"
    return ", ".join(names)


def _short(prim: str) -> str:
    return {"conv_general_dilated": "conv", "dot_general": "dot"}.get(prim, prim)
