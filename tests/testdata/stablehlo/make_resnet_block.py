"""Regenerates resnet_block_jax.mlir: a ResNet basic block lowered by JAX (params as
arguments), as a plain ``jax.jit(...).lower(...).as_text()`` module without hlofold.

    python tests/testdata/stablehlo/make_resnet_block.py
"""
import os

import jax
import jax.numpy as jnp
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))

CHECKS = """\
// A ResNet basic block exported by JAX without hlofold (see make_resnet_block.py): two
// conv+BN pairs, a residual add that reads the block input, relu through @relu calls.
// Both BNs fold; the residual add stays.
// CHECK-LABEL: func.func public @main
// CHECK-COUNT-2: stablehlo.multiply %arg{{[0-9]+}}, {{.*}} : tensor<3x3x8x8xf32>
// CHECK-NOT: stablehlo.subtract {{.*}} : tensor<2x8x8x8xf32>
// CHECK-NOT: stablehlo.multiply {{.*}} : tensor<2x8x8x8xf32>
"""


def bn(y, p):
    return (y - p["mean"]) * (lax.rsqrt(p["var"] + 1e-5) * p["scale"]) + p["bias"]


def block(params, x):
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(bn(conv(x, params["k1"]), params["bn1"]))
    h = bn(conv(h, params["k2"]), params["bn2"])
    return jax.nn.relu(h + x)


def params():
    c = 8
    bnp = lambda: {"mean": jnp.zeros(c), "var": jnp.ones(c), "scale": jnp.ones(c),
                   "bias": jnp.zeros(c)}
    return {"k1": jnp.zeros((3, 3, c, c)), "k2": jnp.zeros((3, 3, c, c)),
            "bn1": bnp(), "bn2": bnp()}


if __name__ == "__main__":
    text = jax.jit(block).lower(params(), jnp.zeros((2, 8, 8, 8))).as_text()
    with open(os.path.join(HERE, "resnet_block_jax.mlir"), "w") as f:
        f.write(CHECKS + text)
