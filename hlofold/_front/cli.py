"""The ``hlofold`` command line (also ``python -m hlofold``): ``fold``, ``verify``, ``report``
on StableHLO artifacts, and ``demo`` (:mod:`hlofold._front.demo`)."""
from __future__ import annotations

import argparse
import sys


from .files import Staged, UsageError as _UsageError, check_distinct, check_output, load as _load


def _inputs(args_path, specs):
    import numpy as np
    if args_path:
        try:
            with np.load(args_path) as z:
                arrays = [z[k] for k in z.files]
        except Exception as e:
            raise _UsageError(f"{args_path}: not a readable .npz file ({e})") from None
        if len(arrays) != len(specs):
            raise _UsageError(f"{args_path} holds {len(arrays)} arrays; the program takes "
                              f"{len(specs)}")
        for i, (a, sp) in enumerate(zip(arrays, specs)):
            if tuple(a.shape) != tuple(sp.shape):
                raise _UsageError(f"input {i}: shape {a.shape}, expected {tuple(sp.shape)}")
        return [a.astype(sp.dtype) for a, sp in zip(arrays, specs)]
    from hlofold._base.tolerance import random_inputs
    if any(not isinstance(d, int) for sp in specs for d in sp.shape):
        raise _UsageError("the program has symbolic shapes: give --inputs")
    return random_inputs(specs)


def _verify_artifacts(original, folded, inputs_path, backends):
    from hlofold._ir.stablehlo.artifacts import input_specs
    from .verify import verify
    import jax
    import numpy as np
    specs = input_specs(original)
    if any(np.dtype(sp.dtype).itemsize == 8 for sp in specs) and \
            not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)    # the module computes in 64 bits
        specs = input_specs(original)
    args = _inputs(inputs_path, specs)
    return verify(original, folded, *args, backends=backends, raise_on_failure=False)


def _read_params(path: str) -> dict:
    import numpy as np
    from hlofold._ir.stablehlo.weights import argument_index
    try:
        with np.load(path) as z:
            params = {k: z[k] for k in z.files}
    except Exception as e:
        raise _UsageError(f"{path}: not a readable .npz file ({e})") from None
    for k in params:
        try:
            argument_index(k)
        except ValueError:
            raise _UsageError(f"{path}: key {k!r} does not name a module argument "
                              "(arg0, arg1, ...)") from None
    return params


def _alpha(text: str):
    """``--alpha``: a number from 0 to 1, or ``search:wNaM``."""
    from hlofold._quant.core.smooth import check_alpha
    try:
        return check_alpha(text if text.startswith("search") else float(text), "--alpha")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1 or search:wNaM "
                                         f"(search:w4a8), got {text!r}") from None


def _read_calibration(path: str, data, params: dict | None) -> list:
    """``--smooth``: for each per-call argument (``argK``, those ``--params`` does not give)
    an array whose first axis runs over the calibration inputs; as lists of arguments."""
    from hlofold._ir.stablehlo.artifacts import input_specs
    from hlofold._ir.stablehlo.weights import argument_index
    bound = {argument_index(k) for k in params or {}}
    calib = _read_params(path)
    want = [i for i in range(len(input_specs(data))) if i not in bound]
    given = sorted(argument_index(k) for k in calib)
    if given != want:
        raise _UsageError(f"{path}: give the per-call arguments "
                          f"{', '.join(f'arg{i}' for i in want)} (a first axis over the "
                          f"calibration inputs); it has {', '.join(sorted(calib)) or 'none'}")
    by = {argument_index(k): v for k, v in calib.items()}
    n = {len(v) for v in by.values()}
    if len(n) != 1 or 0 in n:
        raise _UsageError(f"{path}: every argument needs the same number (≥ 1) of calibration "
                          "inputs along its first axis")
    return [[by[i][j] for i in want] for j in range(n.pop())]


def _npz_bytes(arrays: dict) -> bytes:
    import io
    import numpy as np
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _verify_with_params(data, apply, params, prepared, kept, inputs_path, backends):
    """Original (all arguments) vs apply (kept arguments, then the prepared weights), on
    the kept arguments: random, or from ``--inputs``."""
    import jax
    from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
    from .verify import accumulation_length, verify
    from hlofold._ir.stablehlo.weights import argument_index
    bound = {argument_index(k): v for k, v in params.items()}
    specs = input_specs(data)
    args = _inputs(inputs_path, [specs[i] for i in kept])

    def on_device(art):
        return lambda *a: module_callable(art, jax.config.jax_default_device.platform
                                          if jax.config.jax_default_device else
                                          jax.default_backend())(*a)

    def original(*per_call):
        full, it = [], iter(per_call)
        for i in range(len(specs)):
            full.append(bound[i] if i in bound else next(it))
        return on_device(data)(*full)

    def folded(*per_call):
        return on_device(apply)(*per_call, *prepared)
    return verify(original, folded, *args, backends=backends, raise_on_failure=False,
                  accumulation=accumulation_length(data, None))


def _verify_split(data, apply, prepare, per_call, inputs_path, backends):
    """Original (all arguments) vs prepare-then-apply, on all arguments (random, or from
    ``--inputs``); a prepare whose ``ok`` is false fails the check."""
    import numpy as np
    from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
    from .verify import accumulation_length, verify
    from hlofold._ir.stablehlo.weights import argument_index
    calls = sorted({argument_index(a) for a in per_call})
    specs = input_specs(data)
    args = _inputs(inputs_path, specs)

    # prepare runs once, as it is meant to (for the weights among the inputs)
    *prepared, ok = module_callable(prepare)(*[a for i, a in enumerate(args)
                                               if i not in calls])
    if not bool(np.asarray(ok)):
        raise _UsageError("the prepare module says ok = false for these weights (a "
                          "folded kernel or bias is not finite)")

    def folded(*full):
        return module_callable(apply)(*[full[i] for i in calls], *prepared)
    return verify(module_callable(data), folded, *args, backends=backends,
                  raise_on_failure=False, accumulation=accumulation_length(data, None))


def cmd_fold(args) -> int:
    import json
    from hlofold._front.artifacts import fold_stablehlo
    from hlofold._ir.stablehlo.artifacts import input_specs
    if args.params and not args.prepared_out:
        raise _UsageError("--params needs --prepared-out (where the folded weights go)")
    if args.prepared_out and not args.params:
        raise _UsageError("--prepared-out needs --params (the weights to fold)")
    if bool(args.prepare) != bool(args.per_call):
        raise _UsageError("--prepare (where the prepare module goes) and --per-call (the "
                          "arguments that change per call) go together")
    if args.prepare and args.params:
        raise _UsageError("--prepare makes a module for any weights, --params folds given "
                          "ones: use one of them")
    if (args.equalize or args.smooth) and args.prepare:
        raise _UsageError(f"{'--equalize' if args.equalize else '--smooth'} needs the weights' "
                          "values (--params), not --prepare")
    check_distinct({"the input": args.input, "--params": args.params, "--inputs": args.inputs,
                    "--smooth": args.smooth},
                   {"-o": args.output, "--report": args.report,
                    "--prepared-out": args.prepared_out, "--prepare": args.prepare})
    for out in (args.output, args.report, args.prepared_out, args.prepare):
        check_output(out)             # every output checked before anything is written
    _check_backends(args.backends)
    data = _load(args.input)
    prepared = prepare = None
    params = _read_params(args.params) if args.params else None
    calib = _read_calibration(args.smooth, data, params) if args.smooth else None
    smoothing = dict(smooth=calib, alpha=args.alpha)
    if args.params:
        folded, report, prepared = fold_stablehlo(data, params=params, merge=args.merge,
                                                  equalize=args.equalize, **smoothing)
    elif args.prepare:
        folded, report, prepare = fold_stablehlo(data, split=args.per_call, merge=args.merge)
    else:
        folded, report = fold_stablehlo(data, in_graph=args.in_graph, merge=args.merge,
                                        equalize=args.equalize, **smoothing)
    print(report)
    from hlofold import _compat as C
    verify = args.verify if args.verify is not None else (
        C.untested() and (report.num_folded > 0 or prepare is not None or prepared is not None))
    if verify:
        if prepare is not None:
            vrep = _verify_split(data, folded, prepare, args.per_call, args.inputs,
                                 args.backends)
        elif prepared is not None:
            from hlofold._ir.stablehlo.weights import argument_index
            n = len(input_specs(data))
            kept = [i for i in range(n) if i not in {argument_index(k) for k in params}]
            vrep = _verify_with_params(data, folded, params, prepared, kept, args.inputs,
                                       args.backends)
        else:
            vrep = _verify_artifacts(data, folded, args.inputs, args.backends)
        print(vrep)
        if not vrep.passed:
            print(f"hlofold: verification failed; {args.output} not written", file=sys.stderr)
            return 1
    with Staged() as out:             # all outputs, or none
        if args.report:
            out.add(args.report, json.dumps(report.to_dict(), indent=2))
        if prepared is not None:
            first = len(input_specs(folded)) - len(prepared)
            out.add(args.prepared_out, _npz_bytes(
                {f"arg{first + j}": v for j, v in enumerate(prepared)}))
        if prepare is not None:
            out.add(args.prepare, prepare)
        out.add(args.output, folded)
        out.commit()
    if prepared is not None:
        print(f"wrote {args.prepared_out}: {len(prepared)} folded weights, arguments "
              f"arg{first}.. of {args.output}", file=sys.stderr)
    if prepare is not None:
        print(f"wrote {args.prepare}: the weights in, what {args.output} takes after the "
              "per-call arguments out, then ok (false: run the original module)",
              file=sys.stderr)
    print(f"wrote {args.output} ({report.num_folded} folded)", file=sys.stderr)
    return 0


def _check_backends(backends) -> None:
    """``--backends``: each one a platform or IREE runtime hlofold knows, present here."""
    if not backends:
        return
    from .verify import available_backends, known_backends
    here = available_backends(None)
    for b in backends:
        if b not in known_backends():
            raise _UsageError(f"--backends {b}: not a backend hlofold knows (one of "
                              f"{', '.join(known_backends())})")
        if not available_backends([b]):
            raise _UsageError(f"--backends {b}: not present on this machine (present: "
                              f"{', '.join(here) or 'none'})")


def cmd_verify(args) -> int:
    import json
    check_distinct({"the original": args.original, "the folded": args.folded,
                    "--inputs": args.inputs}, {"--json": args.json})
    check_output(args.json)
    _check_backends(args.backends)
    orig, folded = _load(args.original), _load(args.folded)
    vrep = _verify_artifacts(orig, folded, args.inputs, args.backends)
    print(vrep)
    if args.json:
        with Staged() as out:
            out.add(args.json, json.dumps(vrep.to_dict(), indent=2))
            out.commit()
    return 0 if vrep.passed else 1


def cmd_report(args) -> int:
    from hlofold._front.artifacts import report_stablehlo
    rep = report_stablehlo(_load(args.input), in_graph=args.in_graph)
    print(rep.to_json(indent=2) if args.json else rep)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="hlofold", description="Fold inference BatchNorm into convolutions in JAX programs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_demo = sub.add_parser("demo", help="fold a built-in ResNet and show what happened")
    p_demo.add_argument("--depth", type=int, default=18, choices=[10, 18, 34, 50, 101])
    p_demo.add_argument("--width", type=int, default=32)
    p_demo.add_argument("--batch", type=int, default=4)
    p_demo.add_argument("--size", type=int, default=64, help="image height and width")
    p_demo.add_argument("--rounds", type=int, default=20,
                        help="timing rounds (0 skips the latency comparison)")
    backends = dict(type=lambda s: [b for b in s.split(",") if b], default=None,
                    help="comma-separated platforms to verify on (default: all present)")
    p_fold = sub.add_parser("fold", help="fold a StableHLO artifact (.mlir text, MLIR "
                                         "bytecode, a StableHLO portable artifact, or a "
                                         "serialized jax.export file)")
    p_fold.add_argument("input")
    p_fold.add_argument("-o", "--output", required=True)
    p_fold.add_argument("--report", help="write the fold report as JSON here")
    in_graph = dict(action="store_true", help="fold sites whose weights are module arguments "
                    "with the rescale in the graph, guarded at run time (recomputed on every "
                    "call; by default they are left as they are: give --params to fold them "
                    "once)")
    p_fold.add_argument("--in-graph", **in_graph)
    p_fold.add_argument("--no-merge", dest="merge", action="store_false",
                        help="keep sums of parallel branches (RepVGG, MobileOne, ...) as "
                             "they are; each branch's BatchNorm still folds")
    p_fold.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                        help="run original and folded; refuse to write a folded artifact "
                             "that differs beyond tolerance (default: off on the JAX "
                             "releases hlofold is tested with, on for a newer JAX)")
    p_fold.add_argument("--inputs", help=".npz of inputs for --verify (default: random)")
    p_fold.add_argument("--params", help=".npz of weight values by module argument (arg1=..., "
                        "...): fold them once; the output module takes the other arguments, "
                        "then the folded weights")
    p_fold.add_argument("--prepared-out", help="with --params: write the folded weights here "
                        "(.npz, keyed by the output module's argument)")
    p_fold.add_argument("--prepare", help="write a prepare module here (weights in, folded "
                        "weights out, then ok); the output module takes the --per-call "
                        "arguments, then the prepare module's results")
    p_fold.add_argument("--per-call", type=lambda s: [a for a in s.split(",") if a],
                        help="with --prepare: the arguments that change per call (e.g. arg0); "
                        "the others are weights")
    p_fold.add_argument("--equalize", action="store_true",
                        help="after the fold, equalize the channel ranges of layers joined by "
                        "ReLU, bias, pooling or padding (the outputs stay the same; per-tensor "
                        "int8 of the weights then loses less); needs the weights' values: "
                        "constants, or --params")
    p_fold.add_argument("--smooth", help="SmoothQuant's scales moved into the weights, from "
                        "the activations these calibration inputs give: an .npz with each "
                        "per-call argument (argK) and a first axis over the inputs; needs "
                        "the weights' values: constants, or --params")
    p_fold.add_argument("--alpha", type=_alpha, default=0.5,
                        help="with --smooth: how much of each outlier moves into the weights "
                        "(0 to 1), or search:wNaM (search:w4a8: chosen per pair for N-bit "
                        "weights, M-bit activations)")
    p_fold.add_argument("--backends", **backends)
    p_ver = sub.add_parser("verify", help="compare two StableHLO artifacts numerically")
    p_ver.add_argument("original")
    p_ver.add_argument("folded")
    p_ver.add_argument("--inputs", help=".npz of inputs (default: random, fixed seed)")
    p_ver.add_argument("--backends", **backends)
    p_ver.add_argument("--json", help="write the verification report as JSON here")
    p_rep = sub.add_parser("report", help="what would fold in an artifact, and why not the "
                                          "rest (writes nothing)")
    p_rep.add_argument("input")
    p_rep.add_argument("--json", action="store_true", help="print JSON")
    p_rep.add_argument("--in-graph", **in_graph)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        for name in ("width", "batch", "size"):
            if getattr(args, name) < 1:
                parser.error(f"--{name} must be at least 1")
    from hlofold._ir.stablehlo.ir import StableHLOError
    from hlofold._compat import CompatError
    from .demo import demo
    try:
        return {"fold": cmd_fold, "verify": cmd_verify, "report": cmd_report,
                "demo": demo}[args.command](args)
    except (_UsageError, StableHLOError) as e:
        print(f"hlofold {args.command}: error: {e}", file=sys.stderr)
        return 2
    except CompatError as e:          # this JAX changed what the command needs: nothing written
        print(f"hlofold {args.command}: {e}", file=sys.stderr)
        return 3
    except Exception as e:            # a bug of hlofold's: one line, no partial output
        import os
        if os.environ.get("HLOFOLD_TRACEBACK"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"hlofold {args.command}: internal error ({type(e).__name__}: {first}); nothing "
              f"was written. Please report it with the input (HLOFOLD_TRACEBACK=1 shows the "
              f"traceback)", file=sys.stderr)
        return 4


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
