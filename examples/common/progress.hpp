// SPDX-License-Identifier: Apache-2.0
// Progress of a long run (the quickstart, the benchmarks) on stderr: each phase on a line of its own
// and steps within it rewritten in place, each with the time since the run began. Only when stderr
// is a terminal: in a log or a pipe (CTest, CI, `2> file`) nothing is written, so the output that
// scripts read is the same either way.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace stria::cli {

/// Whether `stream` is a terminal (false where that cannot be asked).
inline bool is_terminal(std::FILE* stream) {
#if defined(__unix__) || defined(__APPLE__)
  return stream != nullptr && isatty(fileno(stream)) == 1;
#else
  (void)stream;
  return false;
#endif
}

class progress {
 public:
  /// Reports on stderr if it is a terminal.
  progress() : progress(stderr, is_terminal(stderr)) {}
  /// Reports on `out` when `enabled` (tests pass a file and true).
  progress(std::FILE* out, bool enabled) : out_(out), enabled_(enabled && out != nullptr) {}
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;
  ~progress() { end_line(); }

  [[nodiscard]] bool enabled() const { return enabled_; }

  /// A new phase: "[   12.3 s] what" on a line of its own.
  void phase(std::string_view what) {
    if (!enabled_) return;
    end_line();
    std::fprintf(out_, "[%8.1f s] %.*s\n", seconds(), static_cast<int>(what.size()), what.data());
    std::fflush(out_);
  }

  /// Step `done` of `total` within a phase: "[   12.3 s] what: done / total", rewriting the line of
  /// the previous step; the line ends at the next phase, or at the last step.
  void step(std::string_view what, long long done, long long total) {
    if (!enabled_) return;
    // \r back to the line's start; ESC [K clears what a longer previous step left after it.
    std::fprintf(out_, "\r[%8.1f s] %.*s: %lld / %lld\033[K", seconds(), static_cast<int>(what.size()), what.data(), done, total);
    open_line_ = true;
    if (done >= total) end_line();
    std::fflush(out_);
  }

 private:
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  void end_line() {
    if (!open_line_) return;
    std::fputc('\n', out_);
    open_line_ = false;
  }

  std::FILE* out_;
  bool enabled_;
  bool open_line_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace stria::cli
