"""StableHLO modules made in code for the tests and the fold-time benchmarks."""
from __future__ import annotations


def huge_module(n: int, constants: bool = False) -> str:
    """n residual blocks (conv, subtract, multiply, residual add, max): 5·n ops + a few; the
    kernel, μ and s are arguments, or (``constants``) constants."""
    conv = ("stablehlo.convolution({x}, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->"
            "[b, 0, 1, f], window = {{stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = "
            "[1, 1], rhs_dilate = [1, 1]}} {{batch_group_count = 1 : i64, feature_group_count ="
            " 1 : i64}} : (tensor<1x4x4x4xf32>, tensor<1x1x4x4xf32>) -> tensor<1x4x4x4xf32>")
    t = "tensor<1x4x4x4xf32>"
    lines = ["module {", f"  func.func @main(%x: {t}, %k: tensor<1x1x4x4xf32>, "
             f"%m: tensor<4xf32>, %s: tensor<4xf32>) -> {t} {{",
             f"    %mb = stablehlo.broadcast_in_dim %m, dims = [3] : (tensor<4xf32>) -> {t}",
             f"    %sb = stablehlo.broadcast_in_dim %s, dims = [3] : (tensor<4xf32>) -> {t}",
             f"    %z = stablehlo.constant dense<0.0> : {t}"]
    cur = "%x"
    for i in range(n):
        lines += [f"    %c{i} = " + conv.format(x=cur),
                  f"    %d{i} = stablehlo.subtract %c{i}, %mb : {t}",
                  f"    %e{i} = stablehlo.multiply %d{i}, %sb : {t}",
                  f"    %r{i} = stablehlo.add %e{i}, {cur} : {t}",
                  f"    %a{i} = stablehlo.maximum %r{i}, %z : {t}"]
        cur = f"%a{i}"
    text = "\n".join(lines + [f"    return {cur} : {t}", "  }", "}"])
    if constants:
        text = text.replace(
            "%k: tensor<1x1x4x4xf32>, %m: tensor<4xf32>, %s: tensor<4xf32>", "%u: tensor<4xf32>"
        ).replace("    %mb =", "    %k = stablehlo.constant dense<0.5> : tensor<1x1x4x4xf32>\n"
                  "    %m = stablehlo.constant dense<0.25> : tensor<4xf32>\n"
                  "    %s = stablehlo.constant dense<2.0> : tensor<4xf32>\n    %mb =")
    return text
