// SPDX-License-Identifier: Apache-2.0
// GPU test helpers: random device tensors rounded to T (never zero) with their exact values as
// float, and the error measure and tolerances the kernels are checked with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "stria/core/device_buffer.cuh"
#include "stria/core/numeric.cuh"
#include "support/random.hpp"

namespace stria::test {

/// Random values rounded to T: the device copy and the exact values as float for the reference.
template <class T>
struct rounded_tensor {
  std::vector<float> host;
  device_buffer<T> device;
};

/// Random values in [-magnitude, magnitude] rounded to T, never zero; `exact` gets them as float.
template <class T>
std::vector<T> random_values(seeded_rng& rng, std::size_t n, float magnitude, std::vector<float>& exact) {
  std::vector<T> values(n);
  exact.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    do values[i] = from_float<T>(rng.uniform(-magnitude, magnitude));
    while (to_float(values[i]) == 0.0f);
    exact[i] = to_float(values[i]);
  }
  return values;
}

template <class T>
rounded_tensor<T> random_tensor(test::seeded_rng& rng, std::size_t count, float magnitude) {
  std::vector<float> host;
  const std::vector<T> values = random_values<T>(rng, count, magnitude, host);
  return {std::move(host), device_buffer<T>(std::span<const T>(values))};
}

template <class T>
device_buffer<T> upload(const std::vector<T>& values) {
  return device_buffer<T>(std::span<const T>(values));
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  return m;
}

/// Max |a - b| over max |b| (both over finite entries; matching infinities pass, others fail).
template <class A>
double max_relative_error(const std::vector<A>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i]) && double(a[i]) == b[i]) continue;
    if (!std::isfinite(double(a[i]))) return INFINITY;
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  }
  const double scale = max_abs(b);
  return worst / (scale > 0 ? scale : 1.0);
}

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, __nv_bfloat16> ? 2e-2 : 4e-3;  // 8 vs 11 mantissa bits in P and dS
}

template <class T>
std::string type_name() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

}  // namespace stria::test
