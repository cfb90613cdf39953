// SPDX-License-Identifier: Apache-2.0
// tensor_view<T, Rank>: a non-owning strided view, usable on host and device (strides in elements).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "stria/core/config.hpp"

namespace stria {

template <class T, std::size_t Rank>
class tensor_view {
  static_assert(Rank >= 1 && Rank <= 4, "tensor_view supports rank 1 to 4");

 public:
  using element_type = T;
  static constexpr std::size_t rank = Rank;

  constexpr tensor_view() = default;

  /// Contiguous row-major view.
  constexpr tensor_view(T* data, const std::array<index_t, Rank>& extents) : data_(data) {
    std::int64_t stride = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      extents_[d] = extents[d];
      strides_[d] = stride;
      stride *= extents[d];
    }
  }

  constexpr tensor_view(T* data, const std::array<index_t, Rank>& extents, const std::array<std::int64_t, Rank>& strides)
      : data_(data) {
    for (std::size_t d = 0; d < Rank; ++d) {
      extents_[d] = extents[d];
      strides_[d] = strides[d];
    }
  }

  /// A view of const elements converts implicitly from a view of mutable ones.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  constexpr tensor_view(const tensor_view<U, Rank>& other) : data_(other.data()) {  // NOLINT(google-explicit-constructor)
    for (std::size_t d = 0; d < Rank; ++d) {
      extents_[d] = other.extent(d);
      strides_[d] = other.stride(d);
    }
  }

  STRIA_HOST_DEVICE constexpr T* data() const { return data_; }
  STRIA_HOST_DEVICE constexpr index_t extent(std::size_t d) const { return extents_[d]; }
  STRIA_HOST_DEVICE constexpr std::int64_t stride(std::size_t d) const { return strides_[d]; }

  STRIA_HOST_DEVICE constexpr std::int64_t size() const {
    std::int64_t n = 1;
    for (std::size_t d = 0; d < Rank; ++d) n *= extents_[d];
    return n;
  }

  STRIA_HOST_DEVICE constexpr bool is_contiguous() const {
    std::int64_t expected = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      if (extents_[d] != 1 && strides_[d] != expected) return false;
      expected *= extents_[d];
    }
    return true;
  }

  /// Unchecked element access; callers validate extents at the API boundary.
  template <class... Indices>
    requires(sizeof...(Indices) == Rank)
  STRIA_HOST_DEVICE constexpr T& operator()(Indices... indices) const {
    const std::int64_t idx[Rank] = {static_cast<std::int64_t>(indices)...};
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < Rank; ++d) offset += idx[d] * strides_[d];
    return data_[offset];
  }

 private:
  T* data_ = nullptr;
  index_t extents_[Rank] = {};
  std::int64_t strides_[Rank] = {};
};

}  // namespace stria
