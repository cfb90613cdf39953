// SPDX-License-Identifier: Apache-2.0
// Command-line numbers for the examples and the benchmarks, parsed one way: the whole argument must
// be the number (no "64k", no trailing characters), within the option's range (sizes start at 1, so
// 0 never stands in for a default), and no value wraps or narrows. A bad one is a
// stria::invalid_argument naming the option, the text and the rule.
#pragma once

#include <charconv>
#include <cmath>
#include <concepts>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <stria/core/error.hpp>

namespace stria::cli {

namespace detail {

template <class Number>
std::string range_rule(std::string_view what, Number min, Number max) {
  std::ostringstream rule;
  rule << "must be " << what << " in [" << min << ", " << max << "]";
  return rule.str();
}

}  // namespace detail

/// The value after option argv[i] (advancing i past it), or an error naming the option.
inline std::string option_value(int argc, char** argv, int& i) {
  if (i + 1 >= argc) throw invalid_argument(argv[i], "(missing)", "needs a value (see --help)");
  return argv[++i];
}

/// The whole of `text` as an integer in [min, max] (decimal, an optional leading '-').
template <std::integral Int>
Int parse_integer(std::string_view option, std::string_view text, Int min = std::numeric_limits<Int>::min(),
                  Int max = std::numeric_limits<Int>::max()) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  // A '-' that an unsigned type cannot parse is a number below the range (or zero: "-0"), not junk.
  if (std::is_unsigned_v<Int> && text.size() > 1 && text[0] == '-' && text.find_first_not_of("0123456789", 1) == std::string_view::npos) {
    if (text.find_first_not_of('0', 1) != std::string_view::npos || min > 0) throw invalid_argument(option, text, detail::range_rule("an integer", +min, +max));
    return Int{0};
  }
  if (error == std::errc::result_out_of_range) throw invalid_argument(option, text, detail::range_rule("an integer", +min, +max));
  if (error != std::errc{} || end != text.data() + text.size()) throw invalid_argument(option, text, "must be an integer (digits only)");
  if (value < min || value > max) throw invalid_argument(option, text, detail::range_rule("an integer", +min, +max));
  return value;
}

/// The whole of `text` as a finite real number in [min, max].
inline double parse_real(std::string_view option, std::string_view text, double min, double max) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range && end == text.data() + text.size())  // 1e-400, 1e400: a number, but not a double
    throw invalid_argument(option, text, "must be a number a double holds (magnitude 0 or within [2.2e-308, 1.8e308])");
  if (error != std::errc{} || end != text.data() + text.size() || !std::isfinite(value))
    throw invalid_argument(option, text, "must be a finite number");
  if (value < min || value > max) throw invalid_argument(option, text, detail::range_rule("a number", min, max));
  return value;
}

/// The whole of `text` as a finite real number greater than `bound` (an open range: "positive" is
/// greater than 0).
inline double parse_real_above(std::string_view option, std::string_view text, double bound) {
  const double value = parse_real(option, text, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity());
  if (!(value > bound)) {
    std::ostringstream rule;
    rule << "must be a number greater than " << bound;
    throw invalid_argument(option, text, rule.str());
  }
  return value;
}

/// A comma-separated list of integers in [min, max] ("8,16,32"), at least one.
template <std::integral Int>
std::vector<Int> parse_integer_list(std::string_view option, std::string_view text, Int min = std::numeric_limits<Int>::min(),
                                    Int max = std::numeric_limits<Int>::max()) {
  std::vector<Int> values;
  for (std::size_t start = 0;;) {
    const std::size_t comma = text.find(',', start);
    values.push_back(parse_integer<Int>(option, text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start), min, max));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return values;
}

}  // namespace stria::cli
