// RMSNorm (γ an argument) -> a projection whose weight is an argument, no bias: in the graph
// γ goes on the kernel (diag(γ)·W), guarded. No shift is absorbed, so the guard checks the
// kernel only and the folded branch adds nothing; nothing multiplies by a constant 1; the
// folded dot reads the program's own x·r (not a copy of it); the guards' `true` is one
// constant at the top of the block.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[T:.*]] = stablehlo.constant dense<true>
// CHECK: stablehlo.rsqrt
// CHECK: %[[XR:.*]] = stablehlo.multiply %arg0, %{{.*}} : tensor<1x8x16xf32>
// CHECK-NOT: stablehlo.multiply %arg0
// CHECK: %[[G:.*]] = stablehlo.broadcast_in_dim %arg1, dims = [0] : (tensor<16xf32>) -> tensor<16x32xf32>
// CHECK-NEXT: %[[K:.*]] = stablehlo.multiply %arg2, %[[G]] : tensor<16x32xf32>
// CHECK-NEXT: %[[F:.*]] = stablehlo.is_finite %[[K]]
// CHECK-NOT: stablehlo.is_finite
// CHECK-NOT: stablehlo.and
// CHECK-NOT: dense<true>
// CHECK: %[[P:.*]] = stablehlo.reduce(%[[F]] init: %[[T]])
// CHECK-NEXT: "stablehlo.if"(%[[P]])
// CHECK-NEXT: %[[Y:.*]] = stablehlo.dot_general %[[XR]], %[[K]]
// CHECK-NEXT: stablehlo.return %[[Y]]
// CHECK-NOT: dense<1.000000e+00>
module {
  func.func @main(%x: tensor<1x8x16xf32>, %arg1: tensor<16xf32>, %arg2: tensor<16x32xf32>) -> tensor<1x8x32xf32> {
    %sq = stablehlo.multiply %x, %x : tensor<1x8x16xf32>
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %sum = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [2] : (tensor<1x8x16xf32>, tensor<f32>) -> tensor<1x8xf32>
    %n = stablehlo.constant dense<1.600000e+01> : tensor<1x8xf32>
    %mean = stablehlo.divide %sum, %n : tensor<1x8xf32>
    %eps = stablehlo.constant dense<9.99999997E-7> : tensor<1x8xf32>
    %v = stablehlo.add %mean, %eps : tensor<1x8xf32>
    %r = stablehlo.rsqrt %v : tensor<1x8xf32>
    %rb = stablehlo.broadcast_in_dim %r, dims = [0, 1] : (tensor<1x8xf32>) -> tensor<1x8x16xf32>
    %xr = stablehlo.multiply %x, %rb : tensor<1x8x16xf32>
    %gb = stablehlo.broadcast_in_dim %arg1, dims = [2] : (tensor<16xf32>) -> tensor<1x8x16xf32>
    %h = stablehlo.multiply %xr, %gb : tensor<1x8x16xf32>
    %y = stablehlo.dot_general %h, %arg2, contracting_dims = [2] x [0] : (tensor<1x8x16xf32>, tensor<16x32xf32>) -> tensor<1x8x32xf32>
    return %y : tensor<1x8x32xf32>
  }
}
