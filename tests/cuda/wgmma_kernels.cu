// SPDX-License-Identifier: Apache-2.0
// Every Hopper (wgmma) attention kernel, for both element types and head dims: the translation unit
// that check_ptxas.cmake compiles to see that ptxas neither serialized their products nor spilled.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "stria/kernel/sparse_backward_wgmma.cuh"
#include "stria/kernel/sparse_forward.cuh"

namespace stria_test {

template <class T, int D>
void instantiate() {
  namespace k = stria::kernel;
  static_cast<void>(&k::sparse_forward_wgmma<T, D>);
  static_cast<void>(&k::sparse_forward_wgmma<T, D, false, true>);  // launched grouped (device::launch_order)
  static_cast<void>(&k::sparse_backward_dkdv_wgmma<T, D>);
  static_cast<void>(&k::sparse_backward_dq_wgmma<T, D>);
  static_cast<void>(&k::sparse_backward_dq_wgmma<T, D, true>);  // launched grouped (backward_options::order)
  static_cast<void>(&k::sparse_backward_dq_stored_wgmma<T, D>);
  static_cast<void>(&k::sparse_backward_dq_stored_wgmma<T, D, true>);
  if constexpr (D == 128) static_cast<void>(&k::sparse_forward_wgmma<T, D, true>);  // the paired forward
}

template void instantiate<__nv_bfloat16, 64>();
template void instantiate<__nv_bfloat16, 128>();
template void instantiate<__half, 64>();
template void instantiate<__half, 128>();

}  // namespace stria_test
