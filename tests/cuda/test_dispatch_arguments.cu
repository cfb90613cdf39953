// SPDX-License-Identifier: Apache-2.0
// Device dispatch rejects bad calls before any CUDA call, naming the argument, the value and the
// rule (runs on machines without a GPU).
#include <doctest/doctest.h>

#include "stria/sharding/dispatch.cuh"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"

using namespace stria;

TEST_CASE("device dispatch names the argument, the value and the rule") {
  const auto* global = reinterpret_cast<const float*>(std::uintptr_t{4096});  // never dereferenced: the checks come first
  auto* shard = reinterpret_cast<float*>(std::uintptr_t{8192});
  CHECK_THROWS_WITH_AS(sharding::dispatch_device(sharding::striped<64>{}, global, shard, 1024, 32, 4, 5, nullptr),
                       doctest::Contains("rank = 5: must lie in [0, world_size = 4)"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::dispatch_device(sharding::striped<64>{}, global, shard, 1000, 32, 4, 0, nullptr),
                       doctest::Contains("seq_len = 1000: must be a positive multiple of 64"), stria::invalid_argument);
  CHECK_THROWS_AS(sharding::dispatch_device(sharding::zigzag{}, global, shard, 192, 32, 2, 0, nullptr), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::dispatch_device(sharding::striped<64>{}, global, shard, 1024, 0, 4, 0, nullptr),
                       doctest::Contains("row_elements = 0"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::undispatch_device(sharding::striped<64>{}, shard + 1, const_cast<float*>(global), 1024, 32, 4, 0, nullptr),
                       doctest::Contains("must be 16-byte aligned"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::dispatch_device(sharding::striped<64>{}, static_cast<const float*>(nullptr), shard, 1024, 32, 4, 0, nullptr),
                       doctest::Contains("global = nullptr: must point to device memory"), stria::invalid_argument);
}
