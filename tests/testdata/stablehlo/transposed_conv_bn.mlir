// Transposed convolution (lhs_dilate = 2) + batch_norm_inference with constants.
// CHECK-LABEL: func.func @main
// CHECK-NOT: batch_norm_inference
// CHECK: stablehlo.convolution
// CHECK-SAME: lhs_dilate = [2, 2]
// CHECK-NEXT: stablehlo.constant
// CHECK-NEXT: stablehlo.broadcast_in_dim {{.*}} dims = [3]
// CHECK-NEXT: stablehlo.add
module {
  func.func @main(%x: tensor<1x4x4x2xf32>, %k: tensor<3x3x2x3xf32>) -> tensor<1x9x9x3xf32> {
    %scale = stablehlo.constant dense<[1.25, -0.5, 0.75]> : tensor<3xf32>
    %offset = stablehlo.constant dense<[0.5, 0.25, -1.0]> : tensor<3xf32>
    %mean = stablehlo.constant dense<[0.1, 0.2, 0.3]> : tensor<3xf32>
    %var = stablehlo.constant dense<[1.5, 0.5, 2.0]> : tensor<3xf32>
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[2, 2], [2, 2]], lhs_dilate = [2, 2], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x2xf32>, tensor<3x3x2x3xf32>) -> tensor<1x9x9x3xf32>
    %1 = "stablehlo.batch_norm_inference"(%0, %scale, %offset, %mean, %var) {epsilon = 1.0e-05 : f32, feature_index = 3 : i64} : (tensor<1x9x9x3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> tensor<1x9x9x3xf32>
    return %1 : tensor<1x9x9x3xf32>
  }
}
