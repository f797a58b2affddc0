// NHWC convolution + batch_norm_inference (feature_index 3) whose parameters are function
// arguments: the multiply goes on the kernel (3x3x3x4), never on the activations.
// CHECK-LABEL: func.func @main
// CHECK-NOT: batch_norm_inference
// CHECK: %[[S:.*]] = stablehlo.broadcast_in_dim {{.*}}, dims = [3] : (tensor<4xf32>) -> tensor<3x3x3x4xf32>
// CHECK: %[[K:.*]] = stablehlo.multiply %arg1, %[[S]] : tensor<3x3x3x4xf32>
// CHECK: %[[Y:.*]] = stablehlo.convolution(%arg0, %[[K]])
// CHECK: stablehlo.add %[[Y]], {{.*}} : tensor<1x8x8x4xf32>
// CHECK-NOT: stablehlo.multiply {{.*}} : tensor<1x8x8x4xf32>
module {
  func.func @main(%arg0: tensor<1x8x8x3xf32>, %arg1: tensor<3x3x3x4xf32>, %scale: tensor<4xf32>, %offset: tensor<4xf32>, %mean: tensor<4xf32>, %var: tensor<4xf32>) -> tensor<1x8x8x4xf32> {
    %0 = stablehlo.convolution(%arg0, %arg1) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x3xf32>, tensor<3x3x3x4xf32>) -> tensor<1x8x8x4xf32>
    %1 = "stablehlo.batch_norm_inference"(%0, %scale, %offset, %mean, %var) {epsilon = 1.0e-05 : f32, feature_index = 3 : i64} : (tensor<1x8x8x4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) -> tensor<1x8x8x4xf32>
    return %1 : tensor<1x8x8x4xf32>
  }
}
