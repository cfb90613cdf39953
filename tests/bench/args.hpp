// SPDX-License-Identifier: Apache-2.0
// Shared by the benchmarks' command lines: the examples' checked number parsing (whole argument,
// range, no narrowing), and a comma-separated list of sizes ("8,16,32").
#pragma once

#include <string_view>
#include <vector>

#include "../../examples/common/cli.hpp"
#include "stria/core/config.hpp"

namespace stria::bench {

/// A list of sizes, each at least 1.
inline std::vector<index_t> parse_sizes(std::string_view option, std::string_view text) {
  return cli::parse_integer_list<index_t>(option, text, 1);
}

}  // namespace stria::bench
