// SPDX-License-Identifier: Apache-2.0
// Device dispatch/undispatch: each rank's shard equals the host split of the same global tensor, for
// every sharding and several world sizes, and undispatching every rank's shard rebuilds the tensor.
#include <doctest/doctest.h>

#include <array>
#include <span>
#include <string>
#include <vector>

#include "stria/core/device_buffer.cuh"
#include "stria/sharding/dispatch.cuh"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "support/random.hpp"

using namespace stria;

namespace {

template <class Sharding>
void check_dispatch(test::seeded_rng& rng, const Sharding& policy, index_t world, const std::string& name) {
  CAPTURE(name);
  CAPTURE(world);
  const index_t seq_len = 2 * world * 128 * 3;
  const std::size_t row = 4 * 8;  // e.g. 4 heads x 8 elements per token
  const std::vector<float> global = rng.values<float>(static_cast<std::size_t>(seq_len) * row);
  const device_buffer<float> global_d{std::span<const float>(global)};
  device_buffer<float> rebuilt(global.size());
  rebuilt.fill_bytes(0);
  const auto expected = sharding::split(policy, std::span<const float>(global), std::array<index_t, 2>{seq_len, static_cast<index_t>(row)}, world);
  for (index_t r = 0; r < world; ++r) {
    device_buffer<float> shard(global.size() / static_cast<std::size_t>(world));
    shard.fill_bytes(0xff);
    sharding::dispatch_device(policy, global_d.data(), shard.data(), seq_len, row, world, r, nullptr);
    CHECK(shard.download() == expected[static_cast<std::size_t>(r)]);
    sharding::undispatch_device(policy, shard.data(), rebuilt.data(), seq_len, row, world, r, nullptr);
  }
  CHECK(rebuilt.download() == global);
}

}  // namespace

TEST_CASE("device dispatch equals the host split for every sharding, and undispatch rebuilds the tensor") {
  STRIA_SEEDED_RNG(rng);
  for (const index_t world : {1, 2, 3, 4, 8}) {
    check_dispatch(rng, sharding::sequential{}, world, "sequential");
    check_dispatch(rng, sharding::zigzag{}, world, "zigzag");
    check_dispatch(rng, sharding::striped<64>{}, world, "striped<64>");
    check_dispatch(rng, sharding::striped<128>{}, world, "striped<128>");
  }
}
