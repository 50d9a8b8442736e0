// The fields rd2h reads of an OpenAI-style completion or chat body, checked before anything is
// registered: the proxy checks only what it routes by (BodyRules::kRoute), the simulator's
// engines everything (kServe). Both refuse with the same words.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::http {

struct PromptLimits {
  size_t max_prompts = 1024;          // prompts in a list (and chat messages)
  size_t max_prompt_tokens = 262144;  // tokens in one token list
};

// Levels of arrays and objects a body may nest. Copying or writing a JSON value recurses
// once per level, so a deeper body (a few hundred KB of brackets) would overflow the stack
// of the proxy or engine thread that copies or forwards it.
inline constexpr size_t kMaxBodyNesting = 64;

// Which fields a check covers: those the proxy needs to route a request, or all of them.
enum class BodyRules { kRoute, kServe };

// Which field a refused body got wrong, for the `param` and `code` of the OpenAI error
// object ("unsupported_parameter" for an option the engines do not offer, else empty).
struct BodyFault {
  std::string param;
  std::string code;
};

// Whether `j` nests arrays and objects more than `max_depth` levels deep, found without
// recursion, keeping one iterator pair per open level.
template <typename Json>
bool nests_deeper_than(const Json& j, size_t max_depth) {
  if (!j.is_structured()) return false;
  using It = typename Json::const_iterator;
  std::vector<std::pair<It, It>> open{{j.cbegin(), j.cend()}};
  while (!open.empty()) {
    if (open.size() > max_depth) return true;
    auto& [next, end] = open.back();
    if (next == end) {
      open.pop_back();
      continue;
    }
    const Json& child = *next;
    ++next;
    if (child.is_structured()) open.emplace_back(child.cbegin(), child.cend());
  }
  return false;
}

// The tokens a request may generate: max_completion_tokens if given, else max_tokens, else
// `fallback`. Call on a body check_openai_body accepted.
template <typename Json>
uint64_t requested_max_tokens(const Json& body, uint64_t fallback) {
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    auto it = body.find(name);
    if (it != body.end() && it->is_number_integer()) return it->template get<uint64_t>();
  }
  return fallback;
}

namespace detail {

// Whether `v` is an integer from `lo` to `hi`.
template <typename Json>
bool integer_in(const Json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.template get<uint64_t>();
    return (lo <= 0 || u >= static_cast<uint64_t>(lo)) && u <= static_cast<uint64_t>(hi);
  }
  return v.is_number_integer() && v.template get<int64_t>() >= lo &&
         v.template get<int64_t>() <= hi;
}

// The checks of check_openai_body by group, on a body that is an object nested no deeper
// than kMaxBodyNesting. Each refuses with an error naming the field at fault (also in
// `*fault`).
template <typename Json>
class OpenAiBodyCheck {
 public:
  OpenAiBodyCheck(const Json& body, const PromptLimits& limits, BodyFault* fault)
      : body_(body), limits_(limits), fault_(fault) {}

  Status refuse(std::string param, std::string message, std::string code = {}) const {
    if (fault_) *fault_ = {std::move(param), std::move(code)};
    return invalid_argument(std::move(message));
  }

  // max_tokens and max_completion_tokens: integers in range.
  Status token_limits() const {
    for (const char* name : {"max_tokens", "max_completion_tokens"}) {
      if (const Json* v = field(name); v && !integer_in(*v, 1, INT32_MAX)) {
        return refuse(
            name, std::string(name) + " must be an integer from 1 to " + std::to_string(INT32_MAX));
      }
    }
    return Status::ok();
  }

  // min_tokens and seed: integers, min_tokens in range.
  Status integers() const {
    if (const Json* v = field("min_tokens"); v && !integer_in(*v, 0, INT32_MAX)) {
      return refuse("min_tokens",
                    "min_tokens must be an integer from 0 to " + std::to_string(INT32_MAX));
    }
    if (const Json* v = field("seed"); v && !v->is_number_integer()) {
      return refuse("seed", "seed must be an integer");
    }
    return Status::ok();
  }

  // The sampling parameters: numbers in their ranges.
  Status sampling() const {
    struct Range {
      const char* name;
      double lo, hi;
    };
    for (const Range& r : {Range{"temperature", 0, 2}, Range{"top_p", 0, 1},
                           Range{"presence_penalty", -2, 2}, Range{"frequency_penalty", -2, 2}}) {
      const Json* v = field(r.name);
      if (v && !(v->is_number() && v->template get<double>() >= r.lo &&
                 v->template get<double>() <= r.hi)) {
        return refuse(r.name, std::string(r.name) + " must be a number from " +
                                  std::to_string(static_cast<int>(r.lo)) + " to " +
                                  std::to_string(static_cast<int>(r.hi)));
      }
    }
    return Status::ok();
  }

  // stream, stream_options and kv_transfer_params: what decides how a request is routed.
  Status routing_types() const {
    if (const Json* v = field("stream"); v && !v->is_boolean()) {
      return refuse("stream", "stream must be a boolean");
    }
    RD2H_RETURN_IF_ERROR(stream_options());
    if (const Json* v = field("kv_transfer_params"); v && !v->is_object()) {
      return refuse("kv_transfer_params", "kv_transfer_params must be an object");
    }
    return Status::ok();
  }

  // The other strings and booleans.
  Status types() const {
    for (const char* name : {"model", "user"}) {
      if (const Json* v = field(name); v && !v->is_string()) {
        return refuse(name, std::string(name) + " must be a string");
      }
    }
    for (const char* name : {"echo", "ignore_eos"}) {
      if (const Json* v = field(name); v && !v->is_boolean()) {
        return refuse(name, std::string(name) + " must be a boolean");
      }
    }
    return Status::ok();
  }

  // Options the engines do not offer: refused, never silently ignored. Call after types().
  Status unsupported_options() const {
    for (const char* name : {"n", "best_of"}) {
      if (const Json* v = field(name)) {
        if (!v->is_number_integer()) return refuse(name, std::string(name) + " must be an integer");
        if (v->template get<int64_t>() != 1) {
          return unsupported(name, std::string(name) + " other than 1");
        }
      }
    }
    if (const Json* v = field("echo"); v && v->template get<bool>()) {
      return unsupported("echo", "echo");
    }
    if (const Json* v = field("logprobs"); v && !(v->is_boolean() && !v->template get<bool>())) {
      return unsupported("logprobs", "logprobs");
    }
    for (const char* name :
         {"top_logprobs", "suffix", "tools", "functions", "function_call", "audio", "prediction"}) {
      if (field(name)) return unsupported(name, name);
    }
    if (const Json* v = field("tool_choice"); v && !(v->is_string() && *v == "none")) {
      return unsupported("tool_choice", "tool_choice other than \"none\"");
    }
    if (const Json* v = field("stop"); v && !(v->is_array() && v->empty())) {
      return unsupported("stop", "stop");
    }
    if (const Json* v = field("logit_bias"); v && !(v->is_object() && v->empty())) {
      return unsupported("logit_bias", "logit_bias");
    }
    if (const Json* v = field("response_format")) {
      auto t = v->is_object() ? v->find("type") : v->end();
      if (t == v->end() || !t->is_string() || *t != "text") {
        return unsupported("response_format", "response_format other than {\"type\": \"text\"}");
      }
    }
    return Status::ok();
  }

  // A chat body's messages: the number of prompts (1), or why they are refused. With
  // `each`, every message is checked too.
  Expected<size_t> messages(bool each) const {
    const Json* messages = field("messages");
    if (!messages) return refuse("messages", "messages is required");
    if (!messages->is_array() || messages->empty()) {
      return refuse("messages", "messages must be a non-empty array");
    }
    if (messages->size() > limits_.max_prompts) {
      return refuse("messages", "messages lists " + std::to_string(messages->size()) +
                                    " messages; the limit is " +
                                    std::to_string(limits_.max_prompts));
    }
    for (size_t i = 0; each && i < messages->size(); ++i) {
      RD2H_RETURN_IF_ERROR(message((*messages)[i], "messages[" + std::to_string(i) + "]"));
    }
    return size_t{1};
  }

  // A completion body's prompt: the number of prompts it lists, or why it is refused.
  Expected<size_t> prompts() const {
    const Json* prompt = field("prompt");
    if (!prompt) return refuse("prompt", "prompt is required");
    if (prompt->is_string()) return size_t{1};
    if (!prompt->is_array()) {
      return refuse("prompt", "prompt must be a string, a list of token ids or a list of prompts");
    }
    if (prompt->empty() || (*prompt)[0].is_number()) {
      RD2H_RETURN_IF_ERROR(token_list(*prompt, "prompt"));
      return size_t{1};
    }
    if (prompt->size() > limits_.max_prompts) {
      return refuse("prompt", "prompt lists " + std::to_string(prompt->size()) +
                                  " prompts; the limit is " + std::to_string(limits_.max_prompts));
    }
    for (size_t i = 0; i < prompt->size(); ++i) {
      const Json& p = (*prompt)[i];
      const std::string name = "prompt[" + std::to_string(i) + "]";
      if (p.is_string()) continue;
      if (!p.is_array()) return refuse(name, name + " must be a string or a list of token ids");
      RD2H_RETURN_IF_ERROR(token_list(p, name));
    }
    return prompt->size();
  }

 private:
  // A field that is null counts as absent, as in OpenAI's API.
  const Json* field(const char* name) const {
    auto it = body_.find(name);
    return it == body_.end() || it->is_null() ? nullptr : &*it;
  }

  Status unsupported(const char* name, const std::string& what) const {
    return refuse(name, what + " is not supported", "unsupported_parameter");
  }

  // stream_options: an object, only with stream true, its include_usage a boolean.
  Status stream_options() const {
    const Json* stream = field("stream");
    const Json* v = field("stream_options");
    if (!v) return Status::ok();
    if (!v->is_object()) return refuse("stream_options", "stream_options must be an object");
    if (!stream || !stream->template get<bool>()) {
      return refuse("stream_options", "stream_options is only allowed when stream is true");
    }
    auto u = v->find("include_usage");
    if (u != v->end() && !u->is_null() && !u->is_boolean()) {
      return refuse("stream_options.include_usage",
                    "stream_options.include_usage must be a boolean");
    }
    return Status::ok();
  }

  // One chat message, named `name`: an object with a string role, its content a string or
  // a list of text parts.
  Status message(const Json& m, const std::string& name) const {
    if (!m.is_object()) return refuse(name, name + " must be an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return refuse(name + ".role", name + ".role must be a string");
    }
    auto c = m.find("content");
    if (c == m.end() || c->is_null() || c->is_string()) return Status::ok();
    if (!c->is_array()) {
      return refuse(name + ".content", name + ".content must be a string or a list of parts");
    }
    for (size_t k = 0; k < c->size(); ++k) {
      RD2H_RETURN_IF_ERROR(content_part((*c)[k], name + ".content[" + std::to_string(k) + "]"));
    }
    return Status::ok();
  }

  // One part of a message's content, named `where`: an object of type "text" with a
  // string text.
  Status content_part(const Json& part, const std::string& where) const {
    auto type = part.is_object() ? part.find("type") : part.end();
    if (type == part.end() || !type->is_string()) {
      return refuse(where, where + " must be an object with a string type");
    }
    if (*type != "text") {
      return refuse(where, where + ": content of type " + type->dump(), "unsupported_parameter");
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return refuse(where + ".text", where + ".text must be a string");
    }
    return Status::ok();
  }

  // A list of token ids, named `name`: integers, no more than the limit.
  Status token_list(const Json& list, const std::string& name) const {
    if (list.size() > limits_.max_prompt_tokens) {
      return refuse(name, name + " lists " + std::to_string(list.size()) +
                              " tokens; the limit is " + std::to_string(limits_.max_prompt_tokens));
    }
    for (const auto& t : list) {
      if (!t.is_number_integer()) return refuse(name, name + " must list integer token ids");
    }
    return Status::ok();
  }

  const Json& body_;
  const PromptLimits& limits_;
  BodyFault* fault_;
};

}  // namespace detail

// The number of prompts the body lists (1 for a single prompt and for chat), or an error
// naming the field at fault (also in `*fault`), under `rules`. `Json` is nlohmann::json or
// ordered_json.
template <typename Json>
Expected<size_t> check_openai_body(const Json& body, bool chat, const PromptLimits& limits,
                                   BodyRules rules, BodyFault* fault = nullptr) {
  const detail::OpenAiBodyCheck<Json> check(body, limits, fault);
  if (!body.is_object()) return check.refuse("", "the body is not a JSON object");
  if (nests_deeper_than(body, kMaxBodyNesting)) {
    return check.refuse("", "the body nests arrays and objects deeper than " +
                                std::to_string(kMaxBodyNesting) + " levels");
  }
  RD2H_RETURN_IF_ERROR(check.token_limits());
  RD2H_RETURN_IF_ERROR(check.routing_types());
  const bool serve = rules == BodyRules::kServe;
  if (serve) {
    RD2H_RETURN_IF_ERROR(check.integers());
    RD2H_RETURN_IF_ERROR(check.sampling());
    RD2H_RETURN_IF_ERROR(check.types());
    RD2H_RETURN_IF_ERROR(check.unsupported_options());
  }
  return chat ? check.messages(serve) : check.prompts();
}

}  // namespace rd2h::http
