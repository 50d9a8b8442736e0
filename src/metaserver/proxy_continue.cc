// A stream that Decode recomputed goes on in a next round as one answer to its client: which
// requests may, the next round's body, and each event rewritten (one id, counted usage, one
// role, the finish held back until the last round).
#include <set>
#include <string>

#include "metaserver/proxy_impl.h"

namespace rd2h::metaserver {

bool Proxy::Impl::continuable(const ordered_json& body, bool chat, size_t prompts) {
  if (prompts != 1) return false;  // a prompt list's choices would each need their round
  // A next round is the prompt and the text so far: only the fields that mean the same on
  // it. Others (n, echo, logprobs, stop strings, tools, response formats, ...) would change
  // the answer at the seam, so such a request ends as Decode ended it.
  static const std::set<std::string, std::less<>> same_on_a_next_round = {"model",
                                                                          "prompt",
                                                                          "messages",
                                                                          "max_tokens",
                                                                          "max_completion_tokens",
                                                                          "min_tokens",
                                                                          "temperature",
                                                                          "top_p",
                                                                          "top_k",
                                                                          "min_p",
                                                                          "seed",
                                                                          "presence_penalty",
                                                                          "frequency_penalty",
                                                                          "repetition_penalty",
                                                                          "ignore_eos",
                                                                          "stream",
                                                                          "stream_options",
                                                                          "user",
                                                                          "kv_transfer_params",
                                                                          "add_generation_prompt",
                                                                          "chat_template_kwargs"};
  for (const auto& [name, value] : body.items()) {
    if (!value.is_null() && same_on_a_next_round.count(name) == 0) return false;
  }
  if (chat) return body.contains("messages") && body["messages"].is_array();
  const auto prompt = body.find("prompt");
  if (prompt == body.end()) return false;
  return prompt->is_string() ||
         (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string());
}

ordered_json Proxy::Impl::next_round_body(const Continuation& c) const {
  ordered_json body = c.body;
  // The prompt and the text so far; the rest of the token budget.
  if (c.chat) {
    body["messages"].push_back({{"role", "assistant"}, {"content", c.text}});
    body["continue_final_message"] = true;
    body["add_generation_prompt"] = false;
  } else if (body["prompt"].is_string()) {
    body["prompt"] = body["prompt"].get<std::string>() + c.text;
  } else {
    body["prompt"][0] = body["prompt"][0].get<std::string>() + c.text;
  }
  if (c.budget) {
    const uint64_t left = *c.budget - std::min(*c.budget, c.tokens);
    for (const char* name : {"max_completion_tokens", "max_tokens"}) {
      if (body.contains(name) && !body[name].is_null()) body[name] = left;
    }
  }
  return body;
}

std::string Proxy::Impl::continue_event(Continuation& c, const std::string& event) {
  const std::string raw = event + "\n\n";
  if (event.rfind("data: ", 0) != 0) return raw;
  const std::string data = event.substr(6);
  if (data == "[DONE]") return c.recomputed ? std::string() : raw;
  auto j = ordered_json::parse(data, nullptr, /*allow_exceptions=*/false);
  // Not an event to follow (or nested too deep to copy and write back safely): as it is.
  if (j.is_discarded() || !j.is_object() || j.contains("error") ||
      http::nests_deeper_than(j, http::kMaxBodyNesting)) {
    return raw;
  }
  if (c.rounds == 0) {
    if (c.id.empty() && j.contains("id") && j["id"].is_string()) {
      c.id = j["id"].get<std::string>();
      c.created = j.value("created", ordered_json());
    }
  } else {
    // One answer: every round's events carry the first round's id.
    if (!c.id.empty()) j["id"] = c.id;
    if (!c.created.is_null()) j["created"] = c.created;
  }
  auto choices = j.find("choices");
  const bool has_choice =
      choices != j.end() && choices->is_array() && !choices->empty() && (*choices)[0].is_object();
  if (!has_choice) return continue_usage(c, j, raw);
  return continue_choice(c, j, (*choices)[0], raw);
}

std::string Proxy::Impl::continue_usage(Continuation& c, ordered_json& j, const std::string& raw) {
  // The usage event, after the last choice.
  auto usage = j.find("usage");
  if (usage == j.end() || !usage->is_object()) return c.recomputed ? std::string() : raw;
  const uint64_t prompt = usage->value("prompt_tokens", uint64_t{0});
  const uint64_t completion = usage->value("completion_tokens", uint64_t{0});
  if (c.rounds == 0) c.prompt_tokens = prompt;
  if (c.recomputed) {
    c.completion_tokens += completion;
    return {};
  }
  if (c.rounds == 0) return raw;  // one round: Decode's own count
  const uint64_t all = c.completion_tokens + completion;
  (*usage)["prompt_tokens"] = c.prompt_tokens;
  (*usage)["completion_tokens"] = all;
  (*usage)["total_tokens"] = c.prompt_tokens + all;
  return "data: " + j.dump() + "\n\n";
}

std::string Proxy::Impl::continue_choice(Continuation& c, ordered_json& j, ordered_json& choice,
                                         const std::string& raw) {
  std::string text;
  if (c.chat) {
    auto delta = choice.find("delta");
    if (delta != choice.end() && delta->is_object()) {
      if (delta->contains("content") && (*delta)["content"].is_string()) {
        text = (*delta)["content"].get<std::string>();
      }
      // The client had the role from the first round.
      if (c.rounds > 0) delta->erase("role");
    }
  } else if (choice.contains("text") && choice["text"].is_string()) {
    text = choice["text"].get<std::string>();
  }
  c.text += text;
  if (!text.empty()) ++c.tokens;
  auto stop = choice.find("stop_reason");
  const bool recomputed = stop != choice.end() && *stop == "recomputed";
  const bool budget_left = !c.budget || c.tokens < *c.budget;
  if (recomputed && budget_left && c.rounds < config.max_reissues) {
    c.recomputed = true;  // the client's answer goes on in the next round
    choice["finish_reason"] = nullptr;
    choice.erase("stop_reason");
    if (text.empty()) return {};
  } else if (recomputed && !budget_left) {
    // Every token asked for has arrived: the answer is whole, whatever Decode lost after.
    choice["finish_reason"] = "length";
    choice.erase("stop_reason");
  } else if (c.rounds == 0) {
    return raw;  // nothing to change: forwarded as Decode wrote it
  } else if (text.empty() && choice["finish_reason"].is_null()) {
    return {};  // the next round's opening event: the client is past it
  }
  return "data: " + j.dump() + "\n\n";
}

bool Proxy::Impl::continue_whole(Continuation& c, ordered_json& j, ordered_json& merged) const {
  auto choices = j.find("choices");
  if (choices == j.end() || !choices->is_array() || choices->size() != 1 ||
      !(*choices)[0].is_object()) {
    if (c.rounds > 0) merged = j;  // not an answer to join: the client gets it as it is
    return false;
  }
  ordered_json& choice = (*choices)[0];
  ordered_json* text = nullptr;
  if (c.chat) {
    auto message = choice.find("message");
    if (message != choice.end() && message->is_object() && message->contains("content") &&
        (*message)["content"].is_string()) {
      text = &(*message)["content"];
    }
  } else if (choice.contains("text") && choice["text"].is_string()) {
    text = &choice["text"];
  }
  uint64_t prompt = 0, completion = 0;
  auto usage = j.find("usage");
  if (usage != j.end() && usage->is_object()) {
    prompt = usage->value("prompt_tokens", uint64_t{0});
    completion = usage->value("completion_tokens", uint64_t{0});
  }
  if (c.rounds == 0) {
    c.prompt_tokens = prompt;
    merged = j;
  }
  const std::string round_text = text != nullptr ? text->get<std::string>() : std::string();
  c.text += round_text;
  c.tokens += completion;
  c.completion_tokens += completion;
  auto stop = choice.find("stop_reason");
  const bool recomputed = stop != choice.end() && *stop == "recomputed";
  const bool budget_left = !c.budget || c.tokens < *c.budget;
  // The answer so far: the first round's id, every round's text, the usage of them all.
  ordered_json& first = merged["choices"][0];
  if (c.chat) {
    first["message"]["content"] = c.text;
  } else {
    first["text"] = c.text;
  }
  first["finish_reason"] = choice.value("finish_reason", ordered_json());
  first["stop_reason"] = choice.value("stop_reason", ordered_json());
  if (merged.contains("usage") && merged["usage"].is_object()) {
    merged["usage"]["prompt_tokens"] = c.prompt_tokens;
    merged["usage"]["completion_tokens"] = c.completion_tokens;
    merged["usage"]["total_tokens"] = c.prompt_tokens + c.completion_tokens;
  }
  if (recomputed && budget_left && c.rounds < config.max_reissues) return true;
  if (recomputed && !budget_left) {
    // Every token asked for has arrived: the answer is whole, whatever Decode lost after.
    first["finish_reason"] = "length";
    first.erase("stop_reason");
  }
  return false;
}

}  // namespace rd2h::metaserver
