#include "text/chat_template.h"

#include "core/error.h"

namespace r3::text {

namespace {
// Bytes of a render's budget per byte of the request: each message's text is copied each time
// the template reads it (the release templates read it a handful of times).
constexpr size_t kBytesPerRequestByte = 32;
}  // namespace

ChatTemplate::ChatTemplate(std::shared_ptr<const Tokenizer> tok, const std::string& source)
    : tok_(std::move(tok)),
      tpl_(source.empty() ? tok_->parsed_chat_template()
                          : std::make_shared<const jinja::Template>(source)) {}

jinja::RenderLimits ChatTemplate::limits_for(const ChatRequest& req) {
  jinja::RenderLimits l;
  const size_t sent = req.messages.dump().size() +
                      (req.tools.is_null() ? 0 : req.tools.dump().size()) +
                      req.kwargs.dump().size();
  l.max_bytes += int64_t(kBytesPerRequestByte * sent);
  return l;
}

std::string ChatTemplate::render(const ChatRequest& req, std::function<bool()> cancelled) const {
  if (!req.messages.is_array() || req.messages.empty())
    throw Error("messages must be a non-empty list");
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const auto& m = req.messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw Error("messages[" + std::to_string(i) + "] must be an object with a string \"role\"");
  }
  if (!req.tools.is_null() && !req.tools.is_array()) throw Error("tools must be a list");
  if (req.continue_final_message && req.add_generation_prompt)
    throw Error("continue_final_message and add_generation_prompt cannot both be true");
  if (!req.kwargs.is_object()) throw Error("chat_template_kwargs must be an object");
  // The context is built inside the render's budget (Template::render_building_context).
  auto make_context = [&] {
    jinja::Dict ctx;
    ctx.emplace_back("messages", jinja::from_json(req.messages));
    ctx.emplace_back("tools", jinja::from_json(req.tools));
    ctx.emplace_back("documents", jinja::Value::none());
    ctx.emplace_back("add_generation_prompt", jinja::Value::boolean(req.add_generation_prompt));
    for (const auto& [name, content] : tok_->special_tokens())
      ctx.emplace_back(name, jinja::Value::string(content));
    for (auto it = req.kwargs.begin(); it != req.kwargs.end(); ++it) {
      bool replaced = false;
      for (auto& kv : ctx)
        if (kv.first == it.key()) kv.second = jinja::from_json(it.value()), replaced = true;
      if (!replaced) ctx.emplace_back(it.key(), jinja::from_json(it.value()));
    }
    return ctx;
  };
  jinja::RenderLimits limits = limits_for(req);
  limits.cancelled = std::move(cancelled);
  std::string text = tpl_->render_building_context(make_context, limits);
  if (req.continue_final_message) {
    // Cut after the final message's content, as Hugging Face does, so the model continues it.
    const auto& last = req.messages.back();
    if (!last.contains("content") || !last["content"].is_string())
      throw Error("continue_final_message needs a final message with string content");
    const std::string content = last["content"];
    const size_t at = text.rfind(content);
    if (content.empty() || at == std::string::npos)
      throw Error(
          "continue_final_message: the final message's content is not in the rendered prompt");
    text.resize(at + content.size());
  }
  return text;
}

std::vector<int32_t> ChatTemplate::encode(const ChatRequest& req) const {
  return tok_->encode(render(req), false);
}

}  // namespace r3::text
