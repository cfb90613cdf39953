// SPDX-License-Identifier: Apache-2.0
// A deterministic mutation fuzzer over what users hand the examples: recorded selection files (the
// planner's JSON reader) and command lines (plan's and the quickstart's options, the checked number
// parsers). Seeds come from tests/fuzz/corpus; each input is a seed mutated 1-8 times (bit flips,
// byte edits, splices of two seeds, repeated runs, brackets, digits and extreme numbers). Every
// input must end in a result or a stria::invalid_argument; anything else (another exception, a
// crash, a sanitizer report in the ASan/UBSan build) fails. CTest runs it with 100000 inputs, seeded
// also with the examples' selection files (good and bad) where they already live.
//   fuzz_inputs INPUTS SEED PATH...   (a path: a directory of seeds, or one seed file)
#include <stria/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/common/cli.hpp"
#include "../../examples/plan/plan_input.hpp"
#include "../../examples/quickstart/options.hpp"

namespace {

struct corpus {
  std::vector<std::string> selections;  // whole JSON files
  std::vector<std::string> command_lines;  // one per line of the cli_*.txt files
};

/// Seeds: .json files are selections; .txt files hold one command line per line.
void add_seed(corpus& c, const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (file.extension() == ".json") c.selections.push_back(text.str());
  else if (file.extension() == ".txt")
    for (std::string line; std::getline(text, line);)
      if (!line.empty()) c.command_lines.push_back(line);
}

corpus load(const std::vector<std::filesystem::path>& paths) {
  corpus c;
  for (const auto& path : paths) {
    if (!std::filesystem::is_directory(path)) {
      add_seed(c, path);
      continue;
    }
    for (const auto& entry : std::filesystem::directory_iterator(path)) add_seed(c, entry.path());
  }
  if (c.selections.empty() || c.command_lines.empty()) throw stria::invalid_argument("seed paths", paths.size(), "need .json selections and .txt command lines");
  return c;
}

class mutator {
 public:
  explicit mutator(std::uint64_t seed) : rng_(seed) {}

  std::string mutate(std::string text, const std::vector<std::string>& others) {
    const int edits = 1 + static_cast<int>(pick(8));
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = text.empty() ? 0 : pick(text.size() + 1);
      switch (pick(10)) {
        case 0:  // flip a bit
          if (!text.empty()) text[at % text.size()] = static_cast<char>(text[at % text.size()] ^ (1 << pick(8)));
          break;
        case 1:  // delete a run
          if (!text.empty()) text.erase(at % text.size(), 1 + pick(8));
          break;
        case 2:  // insert a random byte
          text.insert(at, 1, static_cast<char>(pick(256)));
          break;
        case 3:  // insert a structural character
          text.insert(at, 1, "[]{}\",:-.e0 "[pick(12)]);
          break;
        case 4: {  // an extreme or odd number
          static const char* numbers[] = {"0", "-1", "4294971392", "2147483647", "2147483648", "-2147483649", "1e308", "1e-320", "nan",
                                          "inf", "18446744073709551616", "0.5", "64k", "007", "-0", "1e20"};
          text.insert(at, numbers[pick(std::size(numbers))]);
          break;
        }
        case 5: {  // repeat a run many times (deep nesting, long lists)
          const std::size_t from = text.empty() ? 0 : pick(text.size()), length = 1 + pick(4);
          const std::string run = text.substr(from, length);
          std::string repeated;
          for (std::size_t i = 0, times = 1 + pick(2000); i < times; ++i) repeated += run;
          text.insert(std::min(at, text.size()), repeated);
          break;
        }
        case 6: {  // splice a piece of another seed
          const std::string& other = others[pick(others.size())];
          if (!other.empty()) {
            const std::size_t from = pick(other.size());
            text.insert(std::min(at, text.size()), other.substr(from, 1 + pick(64)));
          }
          break;
        }
        case 7:  // truncate
          text.resize(at % (text.size() + 1));
          break;
        case 8:  // a digit changed
          for (std::size_t i = 0; i < text.size(); ++i) {
            const std::size_t j = (at + i) % text.size();
            if (text[j] >= '0' && text[j] <= '9') {
              text[j] = static_cast<char>('0' + pick(10));
              break;
            }
          }
          break;
        default:  // swap two bytes
          if (text.size() > 1) std::swap(text[at % text.size()], text[pick(text.size())]);
      }
    }
    return text;
  }

 private:
  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(rng_() % n); }
  std::mt19937_64 rng_;
};

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

struct tally {
  long accepted = 0, rejected = 0;
};

/// Runs `body`; a stria::invalid_argument is a clean rejection, anything else a failure (rethrown).
template <class Body>
void expect_clean(tally& t, Body&& body) {
  try {
    body();
    ++t.accepted;
  } catch (const stria::invalid_argument&) {
    ++t.rejected;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: fuzz_inputs INPUTS SEED PATH...\n");
    return 2;
  }
  std::string input;  // the input being tried, printed when it fails
  try {
    const long inputs = stria::cli::parse_integer<long>("INPUTS", argv[1], 1);
    const auto seed = stria::cli::parse_integer<std::uint64_t>("SEED", argv[2]);
    const corpus seeds = load(std::vector<std::filesystem::path>(argv + 3, argv + argc));
    mutator m(seed);
    tally selection, plan_cli, quickstart_cli, numbers;
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < inputs; ++i) {
      if (i % 2 == 0) {
        input = m.mutate(seeds.selections[static_cast<std::size_t>(i / 2) % seeds.selections.size()], seeds.selections);
        expect_clean(selection, [&] {
          std::istringstream in(input);
          (void)plan_input::parse_selection(in, "fuzz.json");
        });
        continue;
      }
      input = m.mutate(seeds.command_lines[static_cast<std::size_t>(i / 2) % seeds.command_lines.size()], seeds.command_lines);
      std::vector<std::string> words = split_words(input);
      bool help = false;
      for (const std::string& w : words) help = help || w == "--help";
      if (help) continue;  // --help prints the usage and exits: not an input to fuzz
      std::vector<char*> args{argv[0]};
      for (std::string& w : words) args.push_back(w.data());
      args.push_back(nullptr);
      const int count = static_cast<int>(args.size()) - 1;
      expect_clean(plan_cli, [&] { (void)plan_input::parse(count, args.data()); });
      expect_clean(quickstart_cli, [&] {
        quickstart::options o = quickstart::parse(count, args.data());
        quickstart::apply_defaults(o, false, 0);
      });
      for (std::size_t k = 0; k < std::min<std::size_t>(words.size(), 3); ++k) {  // the parsers themselves, on a few words
        const std::string& w = words[k];
        expect_clean(numbers, [&] { (void)stria::cli::parse_integer<stria::index_t>("--n", w, 1); });
        expect_clean(numbers, [&] { (void)stria::cli::parse_real("--x", w, 0.0, 1.0); });
        expect_clean(numbers, [&] { (void)stria::cli::parse_integer_list<int>("--list", w); });
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("fuzz_inputs: %ld inputs in %.1f s, every one accepted or rejected with stria::invalid_argument\n", inputs, seconds);
    std::printf("  selections %ld accepted / %ld rejected; plan command lines %ld / %ld; quickstart %ld / %ld; numbers %ld / %ld\n",
                selection.accepted, selection.rejected, plan_cli.accepted, plan_cli.rejected, quickstart_cli.accepted, quickstart_cli.rejected,
                numbers.accepted, numbers.rejected);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_inputs: FAILED with %s on the input (%zu bytes):\n%s\n", e.what(), input.size(), input.substr(0, 400).c_str());
    return 1;
  }
}
