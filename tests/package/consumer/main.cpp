// SPDX-License-Identifier: Apache-2.0
// A consumer of the stria package: builds a step index and runs the host reference on it.
#include <stria/stria.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

#if defined(STRIA_CONSUMER_HAS_CUDA)
int device_part_check();  // device_part.cu
#endif

int main() {
  using namespace stria;
  // One head, two blocks, causal: both diagonal tiles and the tile below them.
  const step_index index = build_step_index({1, 2, 2, true}, {}, {0, 1}, {0, 1}, {{0}, {0, 1}}, {{}, {}});
  index.validate();
  std::vector<float> q(128 * 64), k(128 * 64), v(128 * 64), out(128 * 64), lse(128);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = std::sin(0.1f * static_cast<float>(i));
    k[i] = std::cos(0.07f * static_cast<float>(i));
    v[i] = std::sin(0.03f * static_cast<float>(i) + 1.0f);
  }
  host::reference_forward(tensor_view<const float, 3>(q.data(), {128, 1, 64}), tensor_view<const float, 3>(k.data(), {128, 1, 64}),
                          tensor_view<const float, 3>(v.data(), {128, 1, 64}), index.view(), tile<64, 64, 64>::default_softmax_scale,
                          tensor_view<float, 3>(out.data(), {128, 1, 64}), tensor_view<float, 2>(lse.data(), {1, 128}));
  // Row 0 attends to key 0 alone, so its output is v[0] exactly.
  const bool ok = std::abs(out[0] - v[0]) < 1e-6f && std::isfinite(lse[127]);
#if defined(STRIA_CONSUMER_HAS_CUDA)
  if (device_part_check() != 64) return 1;
#endif
  std::printf("stria consumer: %s (stria %d.%d.%d)\n", ok ? "ok" : "FAILED", version_major, version_minor, version_patch);
  return ok ? 0 : 1;
}
