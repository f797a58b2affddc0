"""Counts of programs: fusions, kernels and cuDNN calls of optimized HLO text, XLA's memory
analysis, equations of a jaxpr (used by ``benchmarks.run``)."""
from __future__ import annotations

import collections
import re

from hlofold import _compat as C

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
_KIND = re.compile(r"\bkind=(k\w+)")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_BLOCK = re.compile(r"/((?:stage\d+_)?block\d+)/")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)")
_TRIVIAL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}
CUDNN_BIAS_ACT = "__cudnn$convBiasActivationForward"


def hlo_counts(text: str) -> dict:
    """Counts from the optimized (post-XLA-pipeline) HLO text of a compiled executable.

    Method: parse every instruction line ``%name = <shape> <opcode>(...)`` and attribute it to
    the computation it is in. ``fusions`` = instructions with opcode ``fusion`` anywhere in
    the module (by ``kind=``); ``entry_ops`` = instructions of the ENTRY computation other
    than parameter/constant/bitcast/get-tuple-element/tuple (≈ the kernels the runtime
    launches); ``convolutions`` = ``convolution`` instructions anywhere (inside fusions too);
    ``custom_call_targets`` = targets of ``custom-call`` instructions (on GPU, cuDNN
    convolutions are ``__cudnn$convForward`` and, fused with bias and activation,
    ``__cudnn$convBiasActivationForward``).

    Per residual block: an ENTRY instruction belongs to the block named in its own
    ``op_name`` metadata (for a fusion, that of its root), i.e. containing
    ``/stage<s>_block<i>/`` or ``/block<i>/``. ``fusions_per_block`` counts ENTRY fusions,
    ``kernels_per_block`` all non-trivial ENTRY instructions, per block; each is counted
    once. ``multi_block_fusions``: ENTRY fusions whose fused computation (recursively)
    holds ops of more than one block; ``spanning_fusions``: ENTRY fusions whose root is in
    no block but whose body holds ops of blocks (XLA:CPU's YNNPACK fusions can take in
    whole stages and end in the head's reduction), with ``blocks_in_spanning_fusions`` the
    number of blocks they take in.
    """
    comp = None
    comps: dict[str, list] = collections.defaultdict(list)   # comp -> [(op, blocks, calls)]
    entry_ops = collections.Counter()
    all_ops = collections.Counter()
    fusion_kinds = collections.Counter()
    targets = collections.Counter()
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = "ENTRY" if m.group(1) else m.group(2)
            continue
        if line.startswith("}"):
            comp = None
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        op = m.group(2)
        all_ops[op] += 1
        if comp == "ENTRY":
            entry_ops[op] += 1
        if op == "custom-call":
            t = _TARGET.search(line)
            targets[t.group(1) if t else "?"] += 1
        if op == "fusion":
            k = _KIND.search(line)
            fusion_kinds[k.group(1) if k else "?"] += 1
        n = _OPNAME.search(line)
        blocks = frozenset(_BLOCK.findall(n.group(1))[-1:]) if n else frozenset()
        calls = []
        for c in _CALLS.findall(line):
            calls.extend(x.strip().lstrip("%") for x in c.split(","))
        comps[comp].append((op, blocks, calls))

    memo: dict[str, frozenset] = {}

    def comp_blocks(name: str, depth: int = 0) -> frozenset:
        if name in memo or depth > 50:
            return memo.get(name, frozenset())
        memo[name] = frozenset()   # cycle guard
        out = set()
        for _, bl, calls in comps.get(name, ()):
            out |= bl
            for c in calls:
                out |= comp_blocks(c, depth + 1)
        memo[name] = frozenset(out)
        return memo[name]

    fusions_pb, kernels_pb = collections.Counter(), collections.Counter()
    multi = entry_fusions = spanning = 0
    spanned: set = set()
    for op, bl, calls in comps.get("ENTRY", ()):
        if op in _TRIVIAL:
            continue
        touched = set(bl)
        for c in calls:
            touched |= comp_blocks(c)
        for b in bl:
            kernels_pb[b] += 1
            if op == "fusion":
                fusions_pb[b] += 1
        if op == "fusion":
            entry_fusions += 1
            multi += len(touched) > 1
            if not bl and touched:
                spanning += 1
                spanned |= touched
    nontrivial = {k: v for k, v in entry_ops.items() if k not in _TRIVIAL}
    return {
        "fusions": sum(fusion_kinds.values()),
        "fusion_kinds": dict(sorted(fusion_kinds.items())),
        "entry_fusions": entry_fusions,
        "fusions_per_block": dict(fusions_pb),
        "fusions_in_blocks": sum(fusions_pb.values()),
        "kernels_per_block": dict(kernels_pb),
        "multi_block_fusions": multi,
        "spanning_fusions": spanning,
        "blocks_in_spanning_fusions": len(spanned),
        "spanned_blocks": sorted(spanned),
        "entry_ops": sum(nontrivial.values()),
        "entry_op_histogram": dict(sorted(nontrivial.items(), key=lambda kv: -kv[1])),
        "convolutions": all_ops.get("convolution", 0),
        "custom_call_targets": dict(targets),
        "cudnn_convs": sum(v for k, v in targets.items() if k.startswith("__cudnn$conv")),
        "cudnn_conv_bias_activation": targets.get(CUDNN_BIAS_ACT, 0),
        "constants_in_entry": entry_ops.get("constant", 0),
        "parameters": entry_ops.get("parameter", 0),
        "hlo_lines": text.count("\n") + 1,
    }


def memory_stats(compiled) -> dict | None:
    """``compiled.memory_analysis()`` in bytes: arguments, outputs, temporaries (XLA's
    buffer assignment), generated code, and ``peak_memory_in_bytes`` where the backend
    reports it."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # pragma: no cover
        return None
    if ma is None:
        return None
    out = {}
    for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes"):
        v = getattr(ma, k, None)
        if v is not None:
            out[k.replace("_in_bytes", "")] = int(v)
    return out


def count_eqns(jaxpr) -> int:
    """Equations of a jaxpr, those of the jaxprs nested in it included."""
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for s in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(s, C.ClosedJaxpr):
                    n += count_eqns(s.jaxpr)
                elif isinstance(s, C.Jaxpr):
                    n += count_eqns(s)
    return n
