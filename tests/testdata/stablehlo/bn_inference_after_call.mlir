// The convolution lives in a private function (a jitted helper holding the layer), the
// stablehlo.batch_norm_inference after its call in @main: the fold crosses the call, as it
// does for BatchNorm arithmetic (the calls' rule read the affine ops from a list that lacked
// batch_norm_inference, so this folded nothing before; issue 66 item 2).
// CHECK-LABEL: func.func @main
// CHECK-NOT: batch_norm_inference
// CHECK-NOT: call @layer
// CHECK: %[[Y:.*]] = stablehlo.convolution
// CHECK: stablehlo.add %[[Y]]
// CHECK-NOT: stablehlo.multiply
// CHECK-NOT: func.func private @layer
module {
  func.func @main(%x: tensor<1x4x4x2xf32>) -> tensor<1x4x4x3xf32> {
    %k = stablehlo.constant dense<[[[[0.5, -1.0, 0.25], [1.5, 0.75, -0.5]]]]> : tensor<1x1x2x3xf32>
    %g = stablehlo.constant dense<[1.5, 0.5, -0.75]> : tensor<3xf32>
    %b = stablehlo.constant dense<[0.1, -0.2, 0.3]> : tensor<3xf32>
    %m = stablehlo.constant dense<[0.5, -0.25, 1.0]> : tensor<3xf32>
    %v = stablehlo.constant dense<[0.9, 1.7, 0.3]> : tensor<3xf32>
    %0 = call @layer(%x, %k) : (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>
    %1 = "stablehlo.batch_norm_inference"(%0, %g, %b, %m, %v) {epsilon = 1.0e-03 : f32, feature_index = 3 : i64} : (tensor<1x4x4x3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> tensor<1x4x4x3xf32>
    return %1 : tensor<1x4x4x3xf32>
  }
  func.func private @layer(%x: tensor<1x4x4x2xf32>, %k: tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32> {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>
    return %0 : tensor<1x4x4x3xf32>
  }
}
