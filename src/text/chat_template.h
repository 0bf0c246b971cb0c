// A model's chat template applied as Hugging Face's apply_chat_template does: the template of
// tokenizer_config.json (or one given per call) rendered by r3's Jinja renderer with messages,
// tools, add_generation_prompt, the tokenizer's special tokens (bos_token, eos_token, ...) and
// any chat_template_kwargs (enable_thinking, ...); continue_final_message leaves the last
// message open for the model to continue.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "text/jinja.h"
#include "text/tokenizer.h"

namespace r3::text {

struct ChatRequest {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // [{"role", "content", ...}]
  nlohmann::ordered_json tools;  // null or a list of tool schemas
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // chat_template_kwargs
};

class ChatTemplate {
 public:
  // The tokenizer's template (parsed once per tokenizer), or `source` when given. r3::Error when
  // there is none, and for a template outside r3's Jinja subset (naming the construct and line).
  ChatTemplate(std::shared_ptr<const Tokenizer> tok, const std::string& source = "");
  // The prompt text. r3::Error for bad messages, for the template's own raise_exception, and
  // when the render exceeds its budget (limits_for). `cancelled` is polled while it renders.
  std::string render(const ChatRequest& req, std::function<bool()> cancelled = {}) const;
  // The prompt's token ids: the text encoded without adding special tokens (the template
  // writes them), as vLLM does.
  std::vector<int32_t> encode(const ChatRequest& req) const;
  // A render's budget: the defaults, with room for bytes growing with the request (a template
  // reads each message's text a few times), so any real conversation renders and no template
  // holds more than a bounded multiple of what the request sent.
  static jinja::RenderLimits limits_for(const ChatRequest& req);

 private:
  std::shared_ptr<const Tokenizer> tok_;
  std::shared_ptr<const jinja::Template> tpl_;
};

}  // namespace r3::text
