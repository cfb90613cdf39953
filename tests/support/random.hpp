// SPDX-License-Identifier: Apache-2.0
// Test randomness: a fresh seed per run (printed on failure), or STRIA_TEST_SEED to replay one.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace stria::test {

/// The sanitized build (ASan + UBSan, about 20x slower) runs every code path on a thinned sweep
/// of configurations; the plain build runs the whole sweep.
#if defined(STRIA_TEST_SANITIZED)
inline constexpr bool full_sweep = false;
#else
inline constexpr bool full_sweep = true;
#endif

/// Whether configuration number `i` of a sweep runs in this build: all of them, or every `stride`-th.
constexpr bool in_sweep(int i, int stride = 3) { return full_sweep || i % stride == 0; }

/// One part of a sweep, for tools too slow to run a whole one in a process (compute-sanitizer
/// racecheck): with STRIA_TEST_PART=i/n a test case runs its configurations i, i + n, i + 2n, ...
/// (numbered by its calls of next()), so n processes cover the sweep; unset, every one runs.
class sweep_part {
 public:
  sweep_part() {
    const char* value = std::getenv("STRIA_TEST_PART");
    if (value == nullptr) return;
    int consumed = 0;
    if (std::sscanf(value, "%d/%d%n", &part_, &parts_, &consumed) != 2 || value[consumed] != '\0' || parts_ < 1 || part_ < 0 || part_ >= parts_)
      throw std::invalid_argument(std::string("STRIA_TEST_PART is \"") + value + "\": it must be i/n with 0 <= i < n (part i of n)");
  }
  /// "i/n", or "all": what a failure's report needs besides the seed (the part decides the draws).
  [[nodiscard]] std::string name() const { return parts_ == 1 ? std::string("all") : std::to_string(part_) + "/" + std::to_string(parts_); }
  /// Whether the sweep's next configuration is this part's.
  bool next() { return count_++ % parts_ == part_; }

 private:
  int part_ = 0, parts_ = 1, count_ = 0;
};

inline std::uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("STRIA_TEST_SEED")) return std::stoull(fixed);
  std::random_device device;
  return (std::uint64_t{device()} << 32) ^ device();
}

/// A generator seeded freshly for each test; the seed is reported with any failure in the test.
struct seeded_rng {
  std::uint64_t seed = fresh_seed();
  std::mt19937_64 engine{seed};

  template <class Real>
  Real uniform(Real lo, Real hi) {
    return std::uniform_real_distribution<Real>(lo, hi)(engine);
  }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine); }
  bool chance(double p) { return std::bernoulli_distribution(p)(engine); }

  /// Values in [-1, 1) with no exact zeros, so unwritten outputs and dropped terms show up.
  template <class Real>
  std::vector<Real> values(std::size_t n) {
    std::vector<Real> out(n);
    for (Real& x : out) {
      do x = uniform<Real>(Real(-1), Real(1));
      while (x == Real(0));
    }
    return out;
  }
};

}  // namespace stria::test

/// Declares `rng` and attaches its seed to every assertion message in the enclosing scope.
#define STRIA_SEEDED_RNG(rng)          \
  ::stria::test::seeded_rng rng;       \
  INFO("STRIA_TEST_SEED=", rng.seed)
