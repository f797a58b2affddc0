// conv + bias add + batch_norm_inference: the bias and the BN shift merge into one add.
// The parameters are arguments, so the site is guarded at run time: the folded form runs
// when K·s and the bias are finite, the original ops otherwise.
// CHECK-LABEL: func.func @main
// CHECK: %[[OK:.*]] = stablehlo.and
// CHECK-NEXT: "stablehlo.if"(%[[OK]])
// CHECK-NEXT: %[[Y:.*]] = stablehlo.convolution
// CHECK-NEXT: stablehlo.broadcast_in_dim
// CHECK-NEXT: stablehlo.add %[[Y]]
// CHECK-NEXT: stablehlo.return
// CHECK-NEXT: }, {
// CHECK-NEXT: stablehlo.convolution
// CHECK-NEXT: stablehlo.add
// CHECK-NEXT: batch_norm_inference
// CHECK-NEXT: stablehlo.return
module {
  func.func @main(%x: tensor<2x8x8x3xf32>, %k: tensor<3x3x3x4xf32>, %bias: tensor<4xf32>, %scale: tensor<4xf32>, %offset: tensor<4xf32>, %mean: tensor<4xf32>, %var: tensor<4xf32>) -> tensor<2x6x6x4xf32> {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x8x8x3xf32>, tensor<3x3x3x4xf32>) -> tensor<2x6x6x4xf32>
    %b = stablehlo.broadcast_in_dim %bias, dims = [3] : (tensor<4xf32>) -> tensor<2x6x6x4xf32>
    %1 = stablehlo.add %0, %b : tensor<2x6x6x4xf32>
    %2 = "stablehlo.batch_norm_inference"(%1, %scale, %offset, %mean, %var) {epsilon = 1.0e-05 : f32, feature_index = 3 : i64} : (tensor<2x6x6x4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) -> tensor<2x6x6x4xf32>
    return %2 : tensor<2x6x6x4xf32>
  }
}
