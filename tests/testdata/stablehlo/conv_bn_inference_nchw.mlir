// NCHW convolution + stablehlo.batch_norm_inference (feature_index 1) with constant
// parameters: the kernel becomes a new constant, no multiply and no batch_norm remain.
// CHECK-LABEL: func.func @main
// CHECK-NOT: batch_norm_inference
// CHECK: %[[K:.*]] = stablehlo.constant dense<{{.*}}> : tensor<4x3x3x3xf32>
// CHECK: %[[Y:.*]] = stablehlo.convolution(%arg0, %[[K]])
// CHECK-NEXT: %[[T:.*]] = stablehlo.constant
// CHECK-NEXT: %[[B:.*]] = stablehlo.broadcast_in_dim %[[T]], dims = [1]
// CHECK-NEXT: %[[O:.*]] = stablehlo.add %[[Y]], %[[B]]
// CHECK-NOT: stablehlo.multiply
// CHECK: return %[[O]]
module {
  func.func @main(%arg0: tensor<2x3x8x8xf32>) -> tensor<2x4x6x6xf32> {
    %k = stablehlo.constant dense<[[[[0.1, -0.2, 0.3], [0.4, 0.5, -0.6], [0.7, 0.8, 0.9]], [[-0.1, 0.2, 0.3], [0.4, -0.5, 0.6], [0.7, 0.8, -0.9]], [[0.5, 0.5, 0.5], [-0.5, 0.5, 0.5], [0.5, 0.5, -0.5]]], [[[0.2, 0.1, 0.0], [0.3, 0.1, -0.2], [0.4, 0.1, 0.2]], [[-0.2, 0.1, 0.0], [0.3, -0.1, 0.2], [0.4, 0.1, -0.2]], [[0.9, -0.8, 0.7], [0.6, 0.5, -0.4], [0.3, 0.2, 0.1]]], [[[1.0, 0.0, -1.0], [0.5, 0.0, -0.5], [0.25, 0.0, -0.25]], [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.3, 0.3, 0.3]], [[-0.3, 0.6, -0.9], [0.2, -0.4, 0.6], [-0.1, 0.2, -0.3]]], [[[0.05, 0.15, 0.25], [0.35, 0.45, 0.55], [0.65, 0.75, 0.85]], [[-0.05, -0.15, -0.25], [0.35, 0.45, 0.55], [-0.65, -0.75, -0.85]], [[0.3, -0.3, 0.3], [-0.3, 0.3, -0.3], [0.3, -0.3, 0.3]]]]> : tensor<4x3x3x3xf32>
    %scale = stablehlo.constant dense<[1.5, 0.5, -0.75, 2.0]> : tensor<4xf32>
    %offset = stablehlo.constant dense<[0.1, -0.2, 0.3, 0.0]> : tensor<4xf32>
    %mean = stablehlo.constant dense<[0.5, -0.25, 1.0, 0.125]> : tensor<4xf32>
    %var = stablehlo.constant dense<[0.9, 1.7, 0.3, 2.5]> : tensor<4xf32>
    %0 = stablehlo.convolution(%arg0, %k) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x3x8x8xf32>, tensor<4x3x3x3xf32>) -> tensor<2x4x6x6xf32>
    %1 = "stablehlo.batch_norm_inference"(%0, %scale, %offset, %mean, %var) {epsilon = 1.0e-03 : f32, feature_index = 1 : i64} : (tensor<2x4x6x6xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) -> tensor<2x4x6x6xf32>
    return %1 : tensor<2x4x6x6xf32>
  }
}
