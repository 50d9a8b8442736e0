// JSON from the network parsed within bounds set before anything is built: one SAX pass
// measures the depth and the weight of the document the text would become, stopping at the
// first bound passed; only text within both is parsed into a document.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "rd2h/common/status.h"

namespace rd2h::http {

struct JsonBounds {
  size_t max_depth = 64;  // levels of arrays and objects
  // Weight of the document: a scalar 1 (one 16-byte value), an array, an object or an
  // object's key 4 (a container or a map node is 50 to 80 bytes), a string or key longer
  // than 15 bytes its length / 16 more. The default holds 2 M numbers (about 32 MB built),
  // more than a 16 MiB body of token ids that passes the prompt limits.
  size_t max_weight = 2'000'000;
};

namespace detail {

template <typename Json>
class BoundsSax : public nlohmann::json_sax<Json> {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  explicit BoundsSax(const JsonBounds& b) : bounds_(b) {}

  bool null() override { return add(1); }
  bool boolean(bool) override { return add(1); }
  bool number_integer(number_integer_t) override { return add(1); }
  bool number_unsigned(number_unsigned_t) override { return add(1); }
  bool number_float(number_float_t, const string_t&) override { return add(1); }
  bool string(string_t& s) override { return add(1 + s.size() / 16); }
  bool binary(binary_t&) override { return add(1); }
  bool start_object(std::size_t) override { return open(); }
  bool key(string_t& k) override { return add(4 + k.size() / 16); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    malformed_ = true;
    return false;
  }

  Status verdict() const {
    if (too_deep_) {
      return invalid_argument("the body nests arrays and objects deeper than " +
                              std::to_string(bounds_.max_depth) + " levels");
    }
    if (too_heavy_) {
      return invalid_argument("the body holds too many values (more than " +
                              std::to_string(bounds_.max_weight) +
                              " numbers' worth; objects and arrays count 4 each)");
    }
    if (malformed_) return invalid_argument("the body is not JSON");
    return Status::ok();
  }

 private:
  bool add(size_t w) {
    weight_ += w;
    too_heavy_ = weight_ > bounds_.max_weight;
    return !too_heavy_;
  }
  bool open() {
    too_deep_ = ++depth_ > bounds_.max_depth;
    return !too_deep_ && add(4);
  }
  bool close() {
    --depth_;
    return true;
  }

  const JsonBounds bounds_;
  size_t depth_ = 0, weight_ = 0;
  bool too_deep_ = false, too_heavy_ = false, malformed_ = false;
};

}  // namespace detail

// `text` as a document when it is JSON within `bounds`; otherwise an error (kInvalidArgument)
// naming the bound it passed, or saying it is not JSON.
template <typename Json>
Expected<Json> parse_bounded(std::string_view text, const JsonBounds& bounds = {}) {
  detail::BoundsSax<Json> sax(bounds);
  const bool whole = Json::sax_parse(text, &sax, nlohmann::detail::input_format_t::json,
                                     /*strict=*/true, /*ignore_comments=*/false);
  if (!whole) {
    Status st = sax.verdict();
    return st.is_ok() ? invalid_argument("the body is not JSON") : st;
  }
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("the body is not JSON");
  return j;
}

}  // namespace rd2h::http
