"""Regenerates keras_tf_args.mlir / keras_tf_args.npz: a small Keras model on the TensorFlow
backend, lowered by TensorFlow to StableHLO with its weights as module arguments, as
TensorFlow users produce it::

    tf.function(lambda x: model(x, training=False), jit_compile=True)
        .experimental_get_compiler_ir(x)(stage="stablehlo")

TensorFlow is not a dependency of the test suite: run this in an environment that has it
(``pip install tensorflow-cpu``), then commit the two files::

    KERAS_BACKEND=tensorflow python tests/testdata/stablehlo/make_keras_tf.py

``keras_tf_args.npz`` holds the weights by module argument (``arg1`` ... ``argN``; ``arg0`` is
the image), ``keras_tf_io.npz`` an input ``x`` and TensorFlow's own output ``y`` for it (the
model in inference mode, with non-trivial BatchNorm statistics).
"""
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

CHECKS = """\
// A Keras model (conv-BN-relu, depthwise-BN-relu, conv+bias-BN, dense) lowered by
// TensorFlow with its weights as module arguments (see make_keras_tf.py). Folded without
// weight values, each BN folds in the graph under a run-time guard; with the values
// (fold_stablehlo(..., params=), tests/fold/stablehlo/test_weight_args.py) they fold once, on the host.
// CHECK-LABEL: func.func @main
// CHECK-COUNT-3: hlofold_guard
// CHECK-NOT: stablehlo.rsqrt {{.*}} : tensor<2x16x16
"""


def model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3), batch_size=2)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(16, 1, use_bias=True)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(4)(x)
    m = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    for layer in m.layers:          # inference statistics that are not the identity
        if isinstance(layer, keras.layers.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.gamma.assign(1 + 0.2 * rng.standard_normal(c))
            layer.beta.assign(0.1 * rng.standard_normal(c))
            layer.moving_mean.assign(0.2 * rng.standard_normal(c))
            layer.moving_variance.assign(np.exp(0.5 * rng.standard_normal(c)))
    return m


def main():
    m = model()
    f = tf.function(lambda x: m(x, training=False), jit_compile=True)
    x = np.random.default_rng(1).standard_normal((2, 16, 16, 3)).astype(np.float32)
    text = f.experimental_get_compiler_ir(tf.constant(x))(stage="stablehlo")
    # the module's arguments after the image are the variables tf.function captured, in
    # the order of f's concrete function's captured inputs
    cf = f.get_concrete_function(tf.TensorSpec(x.shape, tf.float32))
    by_handle = {id(v.value.handle): v.numpy() for v in m.variables}
    captured = [by_handle[id(t)] for t in cf.captured_inputs]
    y = f(tf.constant(x)).numpy()
    with open(os.path.join(HERE, "keras_tf_args.mlir"), "w") as fh:
        fh.write(CHECKS + text)
    np.savez(os.path.join(HERE, "keras_tf_args.npz"),
             **{f"arg{i + 1}": v for i, v in enumerate(captured)})
    np.savez(os.path.join(HERE, "keras_tf_io.npz"), x=x, y=y)
    print(f"wrote keras_tf_args.mlir ({len(text)} chars), keras_tf_args.npz "
          f"({len(captured)} weights), keras_tf_io.npz")


if __name__ == "__main__":
    main()
