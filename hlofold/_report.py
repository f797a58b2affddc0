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


@dataclasses.dataclass
class FoldSite:
    """What happened at one convolution (or other root) of the program."""

    pattern: str                      # name of the pattern that examined the site
    primitive: str                    # root primitive, e.g. "conv_general_dilated"
    status: str                       # FOLDED / REFUSED / CANONICAL / NO_PATTERN
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

    @property
    def folded(self) -> list[FoldSite]:
        return [s for s in self.sites if s.status == FOLDED]

    @property
    def refused(self) -> list[FoldSite]:
        return [s for s in self.sites if s.status == REFUSED]

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
                "sites": [s.to_dict() for s in self.sites]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        c = self.counts()
        head = (f"hlofold: {c.get(FOLDED, 0)} folded, {c.get(REFUSED, 0)} refused, "
                f"{c.get(CANONICAL, 0)} already conv+bias, {c.get(NO_PATTERN, 0)} without a pattern "
                f"({len(self.sites)} sites)")
        p = self.precision
        if p and p.get("reference"):
            head += (f"\nprecision vs a float32 reference: unfolded max|Δ| "
                     f"{p['max_abs_err_unfolded']:.3g} ({p['rel_err_unfolded']:.2e} rel), "
                     f"folded {p['max_abs_err_folded']:.3g} ({p['rel_err_folded']:.2e} rel), "
                     f"ratio {p['ratio']:.2f}")
        if not self.sites:
            return head
        rows = [("#", "status", "op", "layout", "ch", "absorbed", "rescale", "location", "note")]
        for i, s in enumerate(self.sites):
            ch = "" if s.out_channels is None else (
                (f"{s.in_channels}->" if s.in_channels is not None else "") +
                f"{s.out_channels}" + (f" g{s.groups}" if s.groups != 1 else ""))
            loc = s.location
            if s.file is not None:
                loc = f"{s.file.rsplit('/', 1)[-1]}:{s.line}"
            note = s.reason or _compact(s.params) or (s.note or "")
            rows.append((str(i), s.status, _short(s.primitive), s.layout, ch, "·".join(s.absorbed),
                         (s.rescale or "") + ("+guard" if s.guarded else ""), loc, note))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
        lines = [head]
        for r in rows:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1])
        return "\n".join(lines)

    __repr__ = __str__


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
