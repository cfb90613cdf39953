// SPDX-License-Identifier: Apache-2.0
// The exceptions stria throws: every message names the argument (or failing call), the value and the rule.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "stria/core/config.hpp"

namespace stria {

/// A caller passed a value that breaks a documented rule. `argument()` is the parameter's name,
/// `value()` the value as the message shows it, `rule()` the rule: a caller that knows more context
/// (a file's name, say) can throw the same error under a longer argument name.
class invalid_argument : public std::invalid_argument {
 public:
  template <class Value>
  invalid_argument(std::string_view argument, const Value& value, std::string_view rule)
      : invalid_argument(argument, shown(value), rule, 0) {}

  [[nodiscard]] const std::string& argument() const noexcept { return argument_; }
  [[nodiscard]] const std::string& value() const noexcept { return value_; }
  [[nodiscard]] const std::string& rule() const noexcept { return rule_; }

 private:
  invalid_argument(std::string_view argument, std::string value, std::string_view rule, int)
      : std::invalid_argument("stria: " + std::string(argument) + " = " + value + ": " + std::string(rule)),
        argument_(argument),
        value_(std::move(value)),
        rule_(rule) {}

  template <class Value>
  static std::string shown(const Value& value) {
    std::ostringstream out;
    out << value;
    return out.str();
  }

  std::string argument_, value_, rule_;
};

/// A library call (CUDA runtime or NCCL) failed: what was called, where, with which code.
class call_error : public std::runtime_error {
 public:
  call_error(std::string_view library, std::string_view call, int code, std::string_view reason,
             std::source_location where)
      : std::runtime_error(format(library, call, code, reason, where)),
        call_(call),
        code_(code),
        file_(where.file_name()),
        line_(where.line()) {}

  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  [[nodiscard]] int code() const noexcept { return code_; }
  [[nodiscard]] const std::string& file() const noexcept { return file_; }
  [[nodiscard]] unsigned line() const noexcept { return line_; }

 protected:
  /// For failures that a library call did not report itself: `message` is the whole text.
  call_error(const std::string& message, std::string_view call, int code, std::source_location where)
      : std::runtime_error(message), call_(call), code_(code), file_(where.file_name()), line_(where.line()) {}

 private:
  static std::string format(std::string_view library, std::string_view call, int code, std::string_view reason,
                            std::source_location where) {
    std::ostringstream out;
    out << "stria: " << library << " call `" << call << "` failed with code " << code << " (" << reason
        << ") at " << where.file_name() << ":" << where.line();
    return out.str();
  }

  std::string call_;
  int code_;
  std::string file_;
  unsigned line_;
};

/// A CUDA runtime call failed; `code()` is the cudaError_t value. Thrown by STRIA_CUDA_CHECK.
class cuda_error : public call_error {
 public:
  cuda_error(std::string_view call, int code, std::string_view reason,
             std::source_location where = std::source_location::current())
      : call_error("CUDA", call, code, reason, where) {}
};

/// An NCCL call failed; `code()` is the ncclResult_t value. Thrown by STRIA_NCCL_CHECK.
class nccl_error : public call_error {
 public:
  nccl_error(std::string_view call, int code, std::string_view reason,
             std::source_location where = std::source_location::current())
      : call_error("NCCL", call, code, reason, where) {}

  /// NCCL work that a wait gave up on: `message` says which rank waited for what, how long, and
  /// what NCCL reported (`code`: ncclSuccess when it reported nothing). `call()` is "wait".
  static nccl_error stalled(int code, const std::string& message, std::source_location where = std::source_location::current()) {
    return nccl_error("stria: NCCL: " + message, code, where);
  }

 private:
  nccl_error(const std::string& message, int code, std::source_location where) : call_error(message, "wait", code, where) {}
};

/// A communicator could not complete an operation: peers that disagree on it, a peer that failed,
/// or a wait that timed out (never a silent hang).
class comm_error : public std::runtime_error {
 public:
  explicit comm_error(const std::string& what) : std::runtime_error("stria: " + what) {}
};

/// Checked mode found a NaN or an infinity in a result (DESIGN 11: never a silent NaN): the rank,
/// the step (ring step, or solver stage) and the element where it first appeared. `head()` and
/// `token()` are local to this rank's queries (a KV head and token for this rank's dK/dV), or, for a
/// value computed for another rank (a ring's travelling dK/dV, a solver's moved chunk), to
/// `chunk_owner()`'s local tokens.
class non_finite_error : public std::runtime_error {
 public:
  non_finite_error(const std::string& what, index_t rank, index_t step, std::string tensor, index_t head, index_t token,
                   index_t chunk_owner = -1)
      : std::runtime_error(what), rank_(rank), step_(step), tensor_(std::move(tensor)), head_(head), token_(token), chunk_owner_(chunk_owner) {}

  [[nodiscard]] index_t rank() const noexcept { return rank_; }
  [[nodiscard]] index_t step() const noexcept { return step_; }
  /// "O", "LSE", "dQ", "dK" or "dV".
  [[nodiscard]] const std::string& tensor() const noexcept { return tensor_; }
  [[nodiscard]] index_t head() const noexcept { return head_; }
  [[nodiscard]] index_t token() const noexcept { return token_; }
  /// Whose chunk the value belongs to: a ring's dK/dV (its KV chunk's owner), a solver's result
  /// computed for another rank (that rank); -1 for this rank's O, LSE, dQ and solver dK/dV.
  [[nodiscard]] index_t chunk_owner() const noexcept { return chunk_owner_; }

 private:
  index_t rank_, step_;
  std::string tensor_;
  index_t head_, token_, chunk_owner_;
};

}  // namespace stria
