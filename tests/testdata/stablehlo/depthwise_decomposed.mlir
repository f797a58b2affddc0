// Depthwise (feature_group_count = 6) convolution followed by the decomposed BN arithmetic
// JAX emits: subtract / multiply / add with broadcast_in_dim of per-channel arguments.
// CHECK-LABEL: func.func @main
// CHECK: stablehlo.multiply %arg1, {{.*}} : tensor<3x3x1x6xf32>
// CHECK: "stablehlo.if"
// CHECK-NEXT: %[[Y:.*]] = stablehlo.convolution
// CHECK-SAME: feature_group_count = 6
// CHECK-NEXT: stablehlo.broadcast_in_dim {{.*}}, dims = [3] : (tensor<6xf32>) -> tensor<2x6x6x6xf32>
// CHECK-NEXT: stablehlo.add %[[Y]]
// CHECK-NEXT: stablehlo.return
// CHECK-NEXT: }, {
// CHECK-NEXT: stablehlo.convolution
// CHECK-NEXT: stablehlo.subtract {{.*}} : tensor<2x6x6x6xf32>
module {
  func.func @main(%x: tensor<2x8x8x6xf32>, %k: tensor<3x3x1x6xf32>, %mean: tensor<6xf32>, %inv: tensor<6xf32>, %beta: tensor<6xf32>) -> tensor<2x6x6x6xf32> {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 6 : i64} : (tensor<2x8x8x6xf32>, tensor<3x3x1x6xf32>) -> tensor<2x6x6x6xf32>
    %m1 = stablehlo.broadcast_in_dim %mean, dims = [3] : (tensor<6xf32>) -> tensor<1x1x1x6xf32>
    %m2 = stablehlo.broadcast_in_dim %m1, dims = [0, 1, 2, 3] : (tensor<1x1x1x6xf32>) -> tensor<2x6x6x6xf32>
    %1 = stablehlo.subtract %0, %m2 : tensor<2x6x6x6xf32>
    %s1 = stablehlo.broadcast_in_dim %inv, dims = [3] : (tensor<6xf32>) -> tensor<2x6x6x6xf32>
    %2 = stablehlo.multiply %1, %s1 : tensor<2x6x6x6xf32>
    %b1 = stablehlo.broadcast_in_dim %beta, dims = [3] : (tensor<6xf32>) -> tensor<2x6x6x6xf32>
    %3 = stablehlo.add %2, %b1 : tensor<2x6x6x6xf32>
    return %3 : tensor<2x6x6x6xf32>
  }
}
