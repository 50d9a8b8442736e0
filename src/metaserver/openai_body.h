// The fields rd2h reads of an OpenAI-style completion or chat body, checked before anything
// is registered: their types, how deep the body nests, and how many prompts and tokens it
// may list. The proxy and the simulator's engines use it, so both refuse the same bodies
// with the same words.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::metaserver {

struct PromptLimits {
  size_t max_prompts = 1024;          // prompts in a list (and chat messages)
  size_t max_prompt_tokens = 262144;  // tokens in one token list
};

// Levels of arrays and objects a body may nest. Copying or writing a JSON value recurses
// once per level, so a deeper body (a few hundred KB of brackets) would overflow the stack
// of the proxy or engine thread that copies or forwards it.
inline constexpr size_t kMaxBodyNesting = 64;

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

// The number of prompts the body lists (1 for a single prompt and for chat), or an error
// naming the field at fault. `Json` is nlohmann::json or nlohmann::ordered_json.
template <typename Json>
Expected<size_t> check_openai_body(const Json& body, bool chat, const PromptLimits& limits) {
  if (!body.is_object()) return invalid_argument("the body is not a JSON object");
  if (nests_deeper_than(body, kMaxBodyNesting)) {
    return invalid_argument("the body nests arrays and objects deeper than " +
                            std::to_string(kMaxBodyNesting) + " levels");
  }
  auto field = [&](const char* name) -> const Json* {
    auto it = body.find(name);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  };
  if (const Json* v = field("stream"); v && !v->is_boolean()) {
    return invalid_argument("stream must be a boolean");
  }
  if (const Json* v = field("max_tokens");
      v && !(v->is_number_integer() && v->template get<int64_t>() >= 0 &&
             v->template get<int64_t>() <= INT32_MAX)) {
    return invalid_argument("max_tokens must be an integer from 0 to " +
                            std::to_string(INT32_MAX));
  }
  if (const Json* v = field("kv_transfer_params"); v && !v->is_object()) {
    return invalid_argument("kv_transfer_params must be an object");
  }
  auto token_list = [&](const Json& list, const std::string& name) -> Status {
    if (list.size() > limits.max_prompt_tokens) {
      return invalid_argument(name + " lists " + std::to_string(list.size()) +
                              " tokens; the limit is " + std::to_string(limits.max_prompt_tokens));
    }
    for (const auto& t : list) {
      if (!t.is_number_integer()) return invalid_argument(name + " must list integer token ids");
    }
    return Status::ok();
  };
  if (chat) {
    const Json* messages = field("messages");
    if (!messages) return size_t{1};
    if (!messages->is_array()) return invalid_argument("messages must be an array");
    if (messages->size() > limits.max_prompts) {
      return invalid_argument("messages lists " + std::to_string(messages->size()) +
                              " messages; the limit is " + std::to_string(limits.max_prompts));
    }
    for (size_t i = 0; i < messages->size(); ++i) {
      const Json& m = (*messages)[i];
      const std::string name = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) return invalid_argument(name + " must be an object");
      auto c = m.find("content");
      if (c != m.end() && !c->is_null() && !c->is_string()) {
        return invalid_argument(name + ".content must be a string");
      }
    }
    return size_t{1};
  }
  const Json* prompt = field("prompt");
  if (!prompt || prompt->is_string()) return size_t{1};
  if (!prompt->is_array()) {
    return invalid_argument("prompt must be a string, a list of token ids or a list of prompts");
  }
  if (prompt->empty() || (*prompt)[0].is_number()) {
    RD2H_RETURN_IF_ERROR(token_list(*prompt, "prompt"));
    return size_t{1};
  }
  if (prompt->size() > limits.max_prompts) {
    return invalid_argument("prompt lists " + std::to_string(prompt->size()) +
                            " prompts; the limit is " + std::to_string(limits.max_prompts));
  }
  for (size_t i = 0; i < prompt->size(); ++i) {
    const Json& p = (*prompt)[i];
    const std::string name = "prompt[" + std::to_string(i) + "]";
    if (p.is_string()) continue;
    if (!p.is_array()) return invalid_argument(name + " must be a string or a list of token ids");
    RD2H_RETURN_IF_ERROR(token_list(p, name));
  }
  return prompt->size();
}

}  // namespace rd2h::metaserver
