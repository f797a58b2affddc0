// batch_norm_inference normalizes dimension 1, which has the same size (4) as the conv's
// output feature dimension 3, but is a spatial dimension: it must NOT fold (the StableHLO
// pull request's pattern compared sizes only).
// CHECK-LABEL: func.func @main
// CHECK: %[[Y:.*]] = stablehlo.convolution(%arg0, %arg1)
// CHECK-NEXT: "stablehlo.batch_norm_inference"(%[[Y]],
// CHECK-SAME: feature_index = 1
module {
  func.func @main(%arg0: tensor<1x4x4x3xf32>, %arg1: tensor<1x1x3x4xf32>, %scale: tensor<4xf32>, %offset: tensor<4xf32>, %mean: tensor<4xf32>, %var: tensor<4xf32>) -> tensor<1x4x4x4xf32> {
    %0 = stablehlo.convolution(%arg0, %arg1) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x3xf32>, tensor<1x1x3x4xf32>) -> tensor<1x4x4x4xf32>
    %1 = "stablehlo.batch_norm_inference"(%0, %scale, %offset, %mean, %var) {epsilon = 1.0e-05 : f32, feature_index = 1 : i64} : (tensor<1x4x4x4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) -> tensor<1x4x4x4xf32>
    return %1 : tensor<1x4x4x4xf32>
  }
}
