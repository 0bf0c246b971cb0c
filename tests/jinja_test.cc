// r3's Jinja renderer on hand-written templates: Hugging Face's whitespace rules (trim_blocks,
// lstrip_blocks, - and + markers), scoping (loops do not leak, namespaces do), Python's
// printing of values, filters and tests, and every unsupported construct refused with its line.
// The real release templates are compared with python3-jinja2 in chat_template_oracle_test.cc.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <filesystem>

#include "core/error.h"
#include "test_tokenizer.h"
#include "text/chat_template.h"
#include "text/jinja.h"

namespace r3::text::jinja {
namespace {

std::string render(const std::string& src,
                   const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  return Template(src).render(*from_json(ctx).dict);
}

TEST(Jinja, WhitespaceRulesOfApplyChatTemplate) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("a\n  {% if true %}\nb\n  {% endif %}\nc"), "a\nb\nc");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif %}"), "ab");
  EXPECT_EQ(render("x {{- ' y' -}} z"), "x yz");
  EXPECT_EQ(render("a\n  {%+ if true %}b{% endif %}"), "a\n  b");  // + keeps the indentation
  EXPECT_EQ(render("a {# note #}\nb"), "a b");                     // a comment is a block for trim
  EXPECT_EQ(render("{{ 'a' }}\n{{ 'b' }}"), "a\nb");               // expressions keep their newline
}

TEST(Jinja, ScopesValuesFiltersAndTests) {
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = i %}{% endfor "
                   "%}{{ ns.x }}"),
            "2");
  EXPECT_EQ(render("{{ 1.0 }} {{ 0.00001 }} {{ 1e16 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 / 2 }} {{ "
                   "true }} {{ none }}"),
            "1.0 1e-05 1e+16 3 -4 3.5 True None");
  EXPECT_EQ(render("{{ x | tojson }}", {{"x", {{"b", 1}, {"a", {"é", 2.5, nullptr}}}}}),
            R"({"b": 1, "a": ["é", 2.5, null]})");
  EXPECT_EQ(render("{{ x | tojson(indent=2) }}", {{"x", {{"a", {1}}}}}),
            "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(
      render(
          "{{ 'a,b,,c'.split(',') }} {{ '  x y '.split() }} {{ 'abc'[::-1] }} {{ [1,2,3][1:] }}"),
      "['a', 'b', '', 'c'] ['x', 'y'] cba [2, 3]");
  EXPECT_EQ(render("{{ '\\n x \\n'.strip('\\n') }}|{{ ' a ' | trim }}|{{ 'héllo' | length }}|{{ "
                   "'Ab' | upper }}"),
            " x |a|5|AB");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   {{"d", {{"z", 1}, {"a", 2}}}}),
            "z=1;a=2;");
  EXPECT_EQ(
      render(
          "{% for m in ms if m.r == 'u' %}{{ loop.index }}{{ m.c }}{% if not loop.last %},{% endif "
          "%}{% endfor %}",
          {{"ms", {{{"r", "u"}, {"c", "a"}}, {{"r", "s"}, {"c", "b"}}, {{"r", "u"}, {"c", "c"}}}}}),
      "1a,2c");
  EXPECT_EQ(render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% "
                   "continue %}{% endif %}{{ i }}{% endfor %}"),
            "02");
  EXPECT_EQ(render("{{ x is defined }} {{ y is none }} {{ 'a' is string }} {{ 3 is odd }} {{ z is "
                   "not defined }}",
                   {{"y", nullptr}}),
            "False True True True True");
  EXPECT_EQ(
      render(
          "{% macro f(a, b='!') %}[{{ a }}{{ b }}]{% endmacro %}{{ f('x') }}{{ f('y', b='?') }}"),
      "[x!][y?]");
  EXPECT_EQ(
      render(
          "{{ 'yes' if 1 > 2 else 'no' }} {{ 'a' ~ 1 }} {{ 'ab' in 'cabd' }} {{ 2 not in [1] }}"),
      "no a1 True True");
  EXPECT_EQ(render("{{ xs | map('upper') | join(',') }} {{ ms | selectattr('n', 'gt', 1) | "
                   "map(attribute='n') | list }}",
                   {{"xs", {"a", "b"}}, {"ms", {{{"n", 1}}, {{"n", 2}}, {{"n", 3}}}}}),
            "A,B [2, 3]");
}

TEST(Jinja, UnsupportedConstructsAndRaisesAreErrorsWithTheirLine) {
  auto refused = [](const std::string& src, const std::string& needle) {
    try {
      Template t(src);
      t.render({});
      ADD_FAILURE() << "accepted: " << src;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("a\n{% include 'x' %}", "line 2: {% include %} is not supported");
  refused("{{ x | frobnicate }}", "filter 'frobnicate' is not supported");
  refused("\n{{ [2, 1] | sort }}",
          "line 2: filter 'sort' is not supported");  // at parse, with its line
  EXPECT_THROW(Template("{{ [2, 1] | sort }}"), Error);
  refused("\n\n{{ x is prime }}", "line 3: test 'prime' is not supported");
  refused("{% if true %}", "missing {% elif or else or endif %}");
  refused("{{ 'a' + }}", "unexpected end of expression");
  refused("{{ raise_exception('bad roles') }}", "bad roles");
  refused("{{ undefined_thing.attr }}", "'undefined_thing' is undefined");
}

TEST(ChatTemplate, RendersWithTheTokenizersSpecialTokensAndContinuesTheFinalMessage) {
  const std::string dir = testing::write_test_tokenizer(
      (std::filesystem::temp_directory_path() / ("r3_jinja_" + std::to_string(getpid()))).string());
  auto tok = Tokenizer::load(dir);
  EXPECT_EQ(tok->parsed_chat_template(),
            tok->parsed_chat_template());  // parsed once, not per request
  ChatTemplate ct(tok);
  ChatRequest r;
  r.messages = {{{"role", "user"}, {"content", "hi"}}};
  EXPECT_EQ(ct.render(r), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<int32_t> ids = ct.encode(r);
  EXPECT_EQ(ids.front(), *tok->token_to_id("<|im_start|>"));
  r.messages.push_back({{"role", "assistant"}, {"content", "hel"}});
  r.add_generation_prompt = false;
  r.continue_final_message = true;
  EXPECT_EQ(ct.render(r), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhel");
  r.messages = nlohmann::ordered_json::array();
  EXPECT_THROW(ct.render(r), Error);
  EXPECT_THROW(ChatTemplate(tok, "{% bogus %}"), Error);
}

// The kernel's peak resident size of this process (VmHWM), after resetting it to the current
// size, in MiB: how much a call allocated at its worst, whatever it freed before returning.
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }
double peak_resident_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024;
  return 0;
}

// A request's messages and tools become template values inside the render's budget, charged
// before they are made: a list of 4M zeros (8 MB of JSON, ~600 MB as values) is refused having
// allocated at most the budget (128 MB + 32 per byte of the request), not after converting it all.
TEST(ChatTemplate, ARequestsJsonBecomesValuesOnlyWithinTheBudget) {
  const std::string dir = testing::write_test_tokenizer(
      (std::filesystem::temp_directory_path() / ("r3_jinja_budget_" + std::to_string(getpid())))
          .string());
  ChatTemplate ct(Tokenizer::load(dir));
  ChatRequest r;
  r.messages = {{{"role", "user"}, {"content", "hi"}}};
  r.tools = nlohmann::ordered_json::array();
  for (int i = 0; i < 4'000'000; ++i) r.tools.push_back(0);
  reset_peak_resident();
  const double before = peak_resident_mb();
  std::string error;
  try {
    ct.render(r);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("bytes of values"), std::string::npos) << error;
  const double grew = peak_resident_mb() - before;
  EXPECT_LT(grew, 450.0) << "peak grew by " << grew << " MB";
  // A small list renders as before.
  r.tools = nlohmann::ordered_json::array({0, 1});
  EXPECT_EQ(ct.render(r), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  std::filesystem::remove_all(dir);
}

// chat_template.jinja beside tokenizer.json (how GPT-OSS and newer exports store it) is the
// template, in place of tokenizer_config.json's, as transformers loads it.
TEST(ChatTemplate, AChatTemplateJinjaFileReplacesTheConfigsTemplate) {
  const std::string dir = testing::write_test_tokenizer(
      (std::filesystem::temp_directory_path() / ("r3_jinja_file_" + std::to_string(getpid())))
          .string());
  std::ofstream(std::filesystem::path(dir) / "chat_template.jinja")
      << "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
         "{%- if add_generation_prompt %}[assistant] {%- endif %}";
  ChatTemplate ct(Tokenizer::load(dir));
  ChatRequest r;
  r.messages = {{{"role", "user"}, {"content", "hi"}}};
  EXPECT_EQ(ct.render(r), "[user] hi\n[assistant]");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace r3::text::jinja
