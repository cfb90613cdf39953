// SPDX-License-Identifier: Apache-2.0
// The examples' and benchmarks' command-line numbers (examples/common/cli.hpp): whole arguments only,
// ranges checked before any narrowing, errors that name the option, the text and the rule.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "../../examples/common/cli.hpp"
#include "../../examples/common/progress.hpp"

using namespace stria;

namespace {

std::string error_of(auto&& call) {
  try {
    call();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("command-line integers: the whole argument, within the range, no wrap") {
  CHECK(cli::parse_integer<int>("--n", "131072", 1) == 131072);
  CHECK(cli::parse_integer<int>("--n", "-3") == -3);
  CHECK(cli::parse_integer<unsigned long long>("--seed", "18446744073709551615") == 18446744073709551615ull);
  CHECK(error_of([] { cli::parse_integer<std::int32_t>("--seq-len", "4294971392", 1); }) ==
        "stria: --seq-len = 4294971392: must be an integer in [1, 2147483647]");
  CHECK(error_of([] { cli::parse_integer<std::int32_t>("--seq-len", "0", 1); }) == "stria: --seq-len = 0: must be an integer in [1, 2147483647]");
  for (const char* junk : {"64k", "", " 8", "8 ", "0x10", "+8", "1e3", "--", "8,16"})
    CHECK_MESSAGE(error_of([&] { cli::parse_integer<int>("--n", junk); }) == std::string("stria: --n = ") + junk + ": must be an integer (digits only)",
                  junk);
  // A negative number for an unsigned option is below its range (it read as junk: "digits only").
  CHECK(error_of([] { cli::parse_integer<unsigned>("--seed", "-1"); }) == "stria: --seed = -1: must be an integer in [0, 4294967295]");
  CHECK(error_of([] { cli::parse_integer<unsigned>("--seed", "-"); }) == "stria: --seed = -: must be an integer (digits only)");
  CHECK(error_of([] { cli::parse_integer<unsigned>("--seed", "-1x"); }) == "stria: --seed = -1x: must be an integer (digits only)");
  CHECK(cli::parse_integer<unsigned>("--seed", "-0") == 0u);  // zero, as for a signed option
  CHECK(cli::parse_integer<unsigned>("--seed", "-000") == 0u);
  CHECK(error_of([] { cli::parse_integer<unsigned>("--n", "-0", 1u); }) == "stria: --n = -0: must be an integer in [1, 4294967295]");
  CHECK(error_of([] { cli::parse_integer<std::int8_t>("--small", "128"); }) == "stria: --small = 128: must be an integer in [-128, 127]");
}

TEST_CASE("command-line reals: finite, whole argument, within the range") {
  CHECK(cli::parse_real("--sparsity", "0.95", 0.0, 1.0) == doctest::Approx(0.95));
  CHECK(cli::parse_real("--cap", "1e3", 0.0, 1e9) == 1000.0);
  for (const char* junk : {"nan", "inf", "-inf", "0.5x", "", "x"})
    CHECK_MESSAGE(error_of([&] { cli::parse_real("--x", junk, -1e9, 1e9); }) == std::string("stria: --x = ") + junk + ": must be a finite number",
                  junk);
  CHECK(error_of([] { cli::parse_real("--sparsity", "1.5", 0.0, 1.0); }) == "stria: --sparsity = 1.5: must be a number in [0, 1]");
  // Open ranges say so (the smallest positive double printed as the minimum hid the rule).
  CHECK(cli::parse_real_above("--volume-cap", "1e-300", 0.0) == 1e-300);
  CHECK(error_of([] { cli::parse_real_above("--volume-cap", "0", 0.0); }) == "stria: --volume-cap = 0: must be a number greater than 0");
  CHECK(error_of([] { cli::parse_real_above("--rope-theta", "1", 1.0); }) == "stria: --rope-theta = 1: must be a number greater than 1");
  CHECK(error_of([] { cli::parse_real_above("--x", "nan", 0.0); }) == "stria: --x = nan: must be a finite number");
  // Past a double's range: a number, not "non-finite".
  CHECK(error_of([] { cli::parse_real_above("--volume-cap", "1e-400", 0.0); }) ==
        "stria: --volume-cap = 1e-400: must be a number a double holds (magnitude 0 or within [2.2e-308, 1.8e308])");
  CHECK(error_of([] { cli::parse_real("--x", "1e400", 0.0, 1.0); }).find("must be a number a double holds") != std::string::npos);
}

TEST_CASE("command-line lists: every item checked") {
  CHECK(cli::parse_integer_list<int>("--world", "8,16,32", 1) == std::vector<int>{8, 16, 32});
  CHECK(cli::parse_integer_list<int>("--world", "8", 1) == std::vector<int>{8});
  CHECK(error_of([] { cli::parse_integer_list<int>("--world", "8,,16", 1); }) == "stria: --world = : must be an integer (digits only)");
  CHECK(error_of([] { cli::parse_integer_list<int>("--world", "8,0", 1); }).find("--world = 0: must be an integer in [1,") != std::string::npos);
  CHECK(error_of([] { cli::parse_integer_list<int>("--world", "8,", 1); }) == "stria: --world = : must be an integer (digits only)");
}

TEST_CASE("command-line option values: the next argument, or an error naming the option") {
  std::string words[] = {"prog", "--world", "8", "--seq-len"};
  char* argv[] = {words[0].data(), words[1].data(), words[2].data(), words[3].data()};
  int i = 1;
  CHECK(cli::option_value(4, argv, i) == "8");
  CHECK(i == 2);
  i = 3;
  CHECK(error_of([&] { cli::option_value(4, argv, i); }) == "stria: --seq-len = (missing): needs a value (see --help)");
}

namespace {

/// What a progress report wrote to a temporary file.
template <class Report>
std::string progress_text(bool enabled, Report report) {
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  {
    cli::progress p(file, enabled);
    report(p);
  }
  std::string text;
  std::rewind(file);
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) text += static_cast<char>(c);
  std::fclose(file);
  return text;
}

}  // namespace

TEST_CASE("progress: phases on their own lines, steps rewritten in place, each with the elapsed time, nothing when off") {
  auto run = [](cli::progress& p) {
    p.phase("input");
    p.step("forward", 1, 3);
    p.step("forward", 2, 3);
    p.phase("check");  // ends the open step line
    p.step("rows", 1, 1);
  };
  // The text with each time stamp "[ <spaces> digits.digit s]" that opens a line replaced by "[T]";
  // "(bad stamp)" if one is malformed.
  auto stamped = [](const std::string& text) {
    std::string out;
    for (std::size_t i = 0; i < text.size();) {
      const bool line_start = i == 0 || text[i - 1] == '\n' || text[i - 1] == '\r';
      if (text[i] != '[' || !line_start) {  // a stamp opens a line (ESC [K has a '[' too)
        out += text[i++];
        continue;
      }
      const std::size_t close = text.find(" s]", i);
      const std::string stamp = close == std::string::npos ? "" : text.substr(i + 1, close - i - 1);
      const std::size_t digits = stamp.find_first_not_of(' ');
      const bool ok = stamp.size() == 8 && digits != std::string::npos && stamp.size() - digits >= 3 && stamp[stamp.size() - 2] == '.' &&
                      stamp.substr(digits).find_first_not_of("0123456789.") == std::string::npos;
      if (!ok) return std::string("(bad stamp)");
      out += "[T]";
      i = close + 3;
    }
    return out;
  };
  CHECK(stamped(progress_text(true, run)) ==
        "[T] input\n\r[T] forward: 1 / 3\x1b[K\r[T] forward: 2 / 3\x1b[K\n[T] check\n\r[T] rows: 1 / 1\x1b[K\n");
  CHECK(progress_text(false, run).empty());
  // A step line left open is ended when the report goes away.
  CHECK(progress_text(true, [](cli::progress& p) { p.step("x", 1, 2); }).back() == '\n');
  // A file is not a terminal: the default report (stderr in a test run) is off unless stderr is one.
  std::FILE* file = std::tmpfile();
  CHECK_FALSE(cli::is_terminal(file));
  std::fclose(file);
  CHECK_FALSE(cli::is_terminal(nullptr));
}
