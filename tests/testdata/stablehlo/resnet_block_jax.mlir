// A ResNet basic block exported by JAX without hlofold (see make_resnet_block.py): two
// conv+BN pairs, a residual add that reads the block input, relu through @relu calls.
// Both BNs fold; the residual add stays.
// CHECK-LABEL: func.func public @main
// Weights are arguments: each rescaled kernel is guarded at run time (stablehlo.if).
// CHECK: stablehlo.multiply %arg{{[0-9]+}}, {{.*}} : tensor<3x3x8x8xf32>
// CHECK: "stablehlo.if"
// CHECK: stablehlo.multiply %arg{{[0-9]+}}, {{.*}} : tensor<3x3x8x8xf32>
// CHECK: "stablehlo.if"
// CHECK-NOT: "stablehlo.if"
module @jit_block attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>, %arg3: tensor<8xf32>, %arg4: tensor<8xf32>, %arg5: tensor<8xf32>, %arg6: tensor<8xf32>, %arg7: tensor<8xf32>, %arg8: tensor<3x3x8x8xf32>, %arg9: tensor<3x3x8x8xf32>, %arg10: tensor<2x8x8x8xf32>) -> (tensor<2x8x8x8xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.convolution(%arg10, %arg8) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1], reverse = [false, false]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision DEFAULT>, #stablehlo<precision DEFAULT>]} : (tensor<2x8x8x8xf32>, tensor<3x3x8x8xf32>) -> tensor<2x8x8x8xf32>
    %1 = stablehlo.broadcast_in_dim %arg1, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %3 = stablehlo.subtract %0, %2 : tensor<2x8x8x8xf32>
    %cst = stablehlo.constant dense<9.99999974E-6> : tensor<f32>
    %4 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8xf32>
    %5 = stablehlo.add %arg3, %4 : tensor<8xf32>
    %6 = stablehlo.rsqrt %5 : tensor<8xf32>
    %7 = stablehlo.multiply %6, %arg2 : tensor<8xf32>
    %8 = stablehlo.broadcast_in_dim %7, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %9 = stablehlo.broadcast_in_dim %8, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %10 = stablehlo.multiply %3, %9 : tensor<2x8x8x8xf32>
    %11 = stablehlo.broadcast_in_dim %arg0, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %12 = stablehlo.broadcast_in_dim %11, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %13 = stablehlo.add %10, %12 : tensor<2x8x8x8xf32>
    %14 = call @relu(%13) : (tensor<2x8x8x8xf32>) -> tensor<2x8x8x8xf32>
    %15 = stablehlo.convolution(%14, %arg9) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1], reverse = [false, false]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision DEFAULT>, #stablehlo<precision DEFAULT>]} : (tensor<2x8x8x8xf32>, tensor<3x3x8x8xf32>) -> tensor<2x8x8x8xf32>
    %16 = stablehlo.broadcast_in_dim %arg5, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %17 = stablehlo.broadcast_in_dim %16, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %18 = stablehlo.subtract %15, %17 : tensor<2x8x8x8xf32>
    %cst_0 = stablehlo.constant dense<9.99999974E-6> : tensor<f32>
    %19 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<8xf32>
    %20 = stablehlo.add %arg7, %19 : tensor<8xf32>
    %21 = stablehlo.rsqrt %20 : tensor<8xf32>
    %22 = stablehlo.multiply %21, %arg6 : tensor<8xf32>
    %23 = stablehlo.broadcast_in_dim %22, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %24 = stablehlo.broadcast_in_dim %23, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %25 = stablehlo.multiply %18, %24 : tensor<2x8x8x8xf32>
    %26 = stablehlo.broadcast_in_dim %arg4, dims = [3] : (tensor<8xf32>) -> tensor<1x1x1x8xf32>
    %27 = stablehlo.broadcast_in_dim %26, dims = [0, 1, 2, 3] : (tensor<1x1x1x8xf32>) -> tensor<2x8x8x8xf32>
    %28 = stablehlo.add %25, %27 : tensor<2x8x8x8xf32>
    %29 = stablehlo.add %28, %arg10 : tensor<2x8x8x8xf32>
    %30 = call @relu(%29) : (tensor<2x8x8x8xf32>) -> tensor<2x8x8x8xf32>
    return %30 : tensor<2x8x8x8xf32>
  }
  func.func private @relu(%arg0: tensor<2x8x8x8xf32>) -> tensor<2x8x8x8xf32> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2x8x8x8xf32>
    %1 = stablehlo.maximum %arg0, %0 : tensor<2x8x8x8xf32>
    return %1 : tensor<2x8x8x8xf32>
  }
}
