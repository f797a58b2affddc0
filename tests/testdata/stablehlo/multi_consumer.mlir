// The conv output is read by the BN multiply AND returned (a residual-like second reader):
// folding would change what the second reader sees. Nothing folds.
// CHECK-LABEL: func.func @main
// CHECK: %[[Y:.*]] = stablehlo.convolution(%arg0, %arg1)
// CHECK: stablehlo.multiply %[[Y]]
// CHECK: return {{.*}}%[[Y]]
module {
  func.func @main(%x: tensor<1x4x4x2xf32>, %k: tensor<1x1x2x3xf32>, %s: tensor<3xf32>) -> (tensor<1x4x4x3xf32>, tensor<1x4x4x3xf32>) {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>
    %sb = stablehlo.broadcast_in_dim %s, dims = [3] : (tensor<3xf32>) -> tensor<1x4x4x3xf32>
    %1 = stablehlo.multiply %0, %sb : tensor<1x4x4x3xf32>
    return %1, %0 : tensor<1x4x4x3xf32>, tensor<1x4x4x3xf32>
  }
}
