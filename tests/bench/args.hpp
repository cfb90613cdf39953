// SPDX-License-Identifier: Apache-2.0
// Shared by the benchmarks' command lines: the examples' checked number parsing (whole argument,
// range, no narrowing), a comma-separated list of sizes ("8,16,32"), and one of names.
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "../../examples/common/cli.hpp"
#include "stria/core/config.hpp"

namespace stria::bench {

/// A list of sizes, each at least 1.
inline std::vector<index_t> parse_sizes(std::string_view option, std::string_view text) {
  return cli::parse_integer_list<index_t>(option, text, 1);
}

/// The items of a comma-separated list ("dense,vs95"); an empty item between commas stays in, as "".
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  return parts;
}

}  // namespace stria::bench
