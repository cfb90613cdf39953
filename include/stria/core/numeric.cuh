// SPDX-License-Identifier: Apache-2.0
// Conversions between the supported element types (bf16, fp16, fp32) and float, on host and device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "stria/core/config.hpp"

namespace stria {

template <class T>
inline constexpr bool is_attention_element_v =
    std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, float>;

template <class T>
STRIA_HOST_DEVICE float to_float(T x) {
  static_assert(is_attention_element_v<T>, "stria elements are bf16 (__nv_bfloat16), fp16 (__half) or float");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return x;
}

template <class T>
STRIA_HOST_DEVICE T from_float(float x) {
  static_assert(is_attention_element_v<T>, "stria elements are bf16 (__nv_bfloat16), fp16 (__half) or float");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half(x);
  else return x;
}

}  // namespace stria
