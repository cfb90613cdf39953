// SPDX-License-Identifier: Apache-2.0
// A small JSON reader for the plan example (objects, arrays, numbers, strings, true/false/null).
#pragma once

#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace plan_json {

struct value {
  enum class kind { null, boolean, number, string, array, object } type = kind::null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<value> array;
  std::map<std::string, value> object;

  [[nodiscard]] const value* find(const std::string& key) const {
    const auto it = object.find(key);
    return it == object.end() ? nullptr : &it->second;
  }
};

class parser {
 public:
  explicit parser(const std::string& text) : text_(text) {}

  value parse() {
    value v = parse_value();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON at offset " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool take(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }

  value parse_value() {
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end");
    value v;
    const char c = text_[pos_];
    if (c == '{') {
      ++pos_;
      v.type = value::kind::object;
      if (take('}')) return v;
      do {
        skip_space();
        const std::string key = parse_string();
        expect(':');
        v.object[key] = parse_value();
      } while (take(','));
      expect('}');
    } else if (c == '[') {
      ++pos_;
      v.type = value::kind::array;
      if (take(']')) return v;
      do v.array.push_back(parse_value());
      while (take(','));
      expect(']');
    } else if (c == '"') {
      v.type = value::kind::string;
      v.string = parse_string();
    } else if (text_.compare(pos_, 4, "true") == 0 || text_.compare(pos_, 5, "false") == 0) {
      v.type = value::kind::boolean;
      v.boolean = text_[pos_] == 't';
      pos_ += v.boolean ? 4 : 5;
    } else if (text_.compare(pos_, 4, "null") == 0) {
      pos_ += 4;
    } else {
      char* end = nullptr;
      v.number = std::strtod(text_.c_str() + pos_, &end);
      if (end == text_.c_str() + pos_) fail("expected a value");
      v.type = value::kind::number;
      pos_ = static_cast<std::size_t>(end - text_.c_str());
    }
    return v;
  }

  std::string parse_string() {
    if (pos_ >= text_.size() || text_[pos_] != '"') fail("expected a string");
    ++pos_;
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out += text_[pos_++];
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }

  const std::string& text_;
  std::size_t pos_ = 0;
};

}  // namespace plan_json
