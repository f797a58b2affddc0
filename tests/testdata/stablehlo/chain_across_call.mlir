// The BN arithmetic lives in a private function called with the conv output (what JAX
// emits for a jitted BN helper). The chain continues into the call: hlofold inlines it and
// folds; the now-unused private function is removed.
// CHECK-LABEL: func.func @main
// CHECK: stablehlo.multiply %arg1, {{.*}} : tensor<1x1x2x3xf32>
// CHECK: %[[Y:.*]] = stablehlo.convolution
// CHECK: stablehlo.add %[[Y]]
// CHECK-NOT: call @bn
// CHECK-NOT: func.func private @bn
module {
  func.func @main(%x: tensor<1x4x4x2xf32>, %k: tensor<1x1x2x3xf32>, %m: tensor<3xf32>, %s: tensor<3xf32>) -> tensor<1x4x4x3xf32> {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>
    %1 = call @bn(%0, %m, %s) : (tensor<1x4x4x3xf32>, tensor<3xf32>, tensor<3xf32>) -> tensor<1x4x4x3xf32>
    return %1 : tensor<1x4x4x3xf32>
  }
  func.func private @bn(%y: tensor<1x4x4x3xf32>, %m: tensor<3xf32>, %s: tensor<3xf32>) -> tensor<1x4x4x3xf32> {
    %mb = stablehlo.broadcast_in_dim %m, dims = [3] : (tensor<3xf32>) -> tensor<1x4x4x3xf32>
    %0 = stablehlo.subtract %y, %mb : tensor<1x4x4x3xf32>
    %sb = stablehlo.broadcast_in_dim %s, dims = [3] : (tensor<3xf32>) -> tensor<1x4x4x3xf32>
    %1 = stablehlo.multiply %0, %sb : tensor<1x4x4x3xf32>
    return %1 : tensor<1x4x4x3xf32>
  }
}
