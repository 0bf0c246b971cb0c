// r3's renderer of the Jinja subset Hugging Face chat templates use, with the environment
// apply_chat_template sets up (trim_blocks, lstrip_blocks, loop controls, a tojson that keeps
// non-ASCII text, raise_exception, strftime_now). Statements: if/elif/else, for (with loop.*,
// unpacking, an if filter, else, break/continue), set (names, namespace attributes, blocks),
// macro; expressions with Python's operators, slices, calls, filters and tests. A construct
// outside the subset is an r3::Error naming it and the template line, when the template is
// parsed, never a different rendering.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "text/jinja_budget.h"
#include "text/jinja_value.h"

namespace r3::text::jinja {

struct Node;

class Template {
 public:
  // Throws r3::Error ("chat template line N: ...") for syntax outside the subset, literals that
  // do not parse, and nesting past kMaxTemplateNesting.
  explicit Template(const std::string& source);
  ~Template();
  Template(Template&&) noexcept;
  // context: the template's variables (messages, tools, add_generation_prompt, bos_token, ...).
  // Throws r3::Error for a runtime error, raise_exception's message included, and when the
  // render exceeds `limits` (text/jinja_budget.h). The context is copied, never changed.
  std::string render(const Dict& context, const RenderLimits& limits = {}) const;
  // The same, with the context built by `make_context` inside the render's budget: what it makes
  // (from_json of a request's messages and tools) is charged and owned like any value the
  // template makes, so a request's JSON cannot grow into values beyond the budget.
  std::string render_building_context(const std::function<Dict()>& make_context,
                                      const RenderLimits& limits = {}) const;

 private:
  std::shared_ptr<Node> root_;
};

}  // namespace r3::text::jinja
