// Hostile templates: every reproduction of issue 48 (memory bombs, unbounded recursion and
// nesting, integer traps, loops that pin a core, literals that do not parse, values that contain
// themselves) ends in an r3::Error naming the template line, within its budget, and never in a
// crash, a hang or a leak. Each budget is also shown to be the thing that stops it: a render
// within the budget succeeds.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "core/error.h"
#include "text/jinja.h"

namespace r3::text::jinja {
namespace {

std::string render(const std::string& src, const RenderLimits& limits = {}) {
  return Template(src).render({}, limits);
}

// The error of a render (or of parsing), "" when it succeeds.
std::string error_of(const std::string& src, const RenderLimits& limits = {}) {
  try {
    render(src, limits);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_refused(const std::string& src, const std::string& words,
                    const RenderLimits& limits = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of(src, limits);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(e.find("chat template line"), std::string::npos) << src.substr(0, 80) << " -> " << e;
  EXPECT_NE(e.find(words), std::string::npos) << src.substr(0, 80) << " -> " << e;
  EXPECT_LT(s, 15.0) << src.substr(0, 80);
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST(JinjaBudget, MemoryBombsAreRefusedBeforeTheyAllocate) {
  expect_refused("{% for i in range(10**9) %}{% endfor %}", "bytes of values");
  expect_refused("{{ 'a' * 10**10 }}", "bytes of values");
  expect_refused(
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% "
      "endfor %}",
      "bytes of values");
  expect_refused("{{ 'a\nb' | indent(10**9) }}", "bytes of values");
  expect_refused("{{ [[[[1]]]] | tojson(indent=10**8) }}", "bytes of values");
  expect_refused("{% set ns = namespace(a='x' * 10**9) %}", "bytes of values");
  expect_refused(
      "{% set l = [] %}{% for i in range(10**6) %}{{ l.append('y' * 1000) }}{% endfor %}",
      "bytes of values");
  // The same constructs within the budget render.
  EXPECT_EQ(render("{{ 'ab' * 3 }}{{ 'a\nb' | indent(2) }}{{ range(3) | list }}"),
            "ababab"
            "a\n  b"
            "[0, 1, 2]");
}

TEST(JinjaBudget, RecursionAndNestingAreBounded) {
  expect_refused("{% macro f(g) %}{{ g(g) }}{% endmacro %}{{ f(f) }}",
                 "deeper than");  // a macro calling itself
  const int deep = 100000;
  expect_refused("{{ " + repeat("(", deep) + "1" + repeat(")", deep) + " }}", "nests deeper");
  expect_refused("{{ " + repeat("[", deep) + "1" + repeat("]", deep) + " }}", "nests deeper");
  expect_refused("{{ " + repeat("not ", deep) + "1 }}", "nests deeper");
  expect_refused("{{ " + repeat("- ", deep) + "1 }}", "nests deeper");
  expect_refused(repeat("{% if true %}", 20000) + repeat("{% endif %}", 20000), "nests deeper");
  expect_refused("{{ 1" + repeat(" + 1", deep) + " }}",
                 "nests deeper");  // a chain, built by a loop
  expect_refused("{{ x" + repeat(" | trim", deep) + " }}", "nests deeper");
  expect_refused("{{ x" + repeat(".a", deep) + " }}", "nests deeper");
  // Values nested by a loop: printing refuses, freeing does not recurse.
  expect_refused(
      "{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = [ns.l] %}{% endfor "
      "%}{{ ns.l }}",
      "nested deeper");
  // Within the limits.
  EXPECT_EQ(render("{{ " + repeat("(", 50) + "1" + repeat(")", 50) + " }}"), "1");
  EXPECT_EQ(render("{% macro f(g, n) %}{% if n > 0 %}{{ g(g, n - 1) }}{% endif %}{{ n }}{% "
                   "endmacro %}{{ f(f, 5) }}"),
            "012345");
}

TEST(JinjaBudget, ValuesThatContainThemselvesPrintAsPythonAndDoNotLeak) {
  EXPECT_EQ(render("{% set l = [1] %}{{ l.append(l) }}{{ l }}"), "None[1, [...]]");
  EXPECT_EQ(render("{% set l = [] %}{{ l.append(l) }}{{ l == l }} {{ l in [l] }}"),
            "NoneTrue True");
  expect_refused("{% set l = [] %}{{ l.append(l) }}{{ l | tojson }}", "circular reference");
  expect_refused("{% set a = [] %}{% set b = [] %}{{ a.append(a) }}{{ b.append(b) }}{{ a == b }}",
                 "nested deeper");
  // The render's containers are emptied when it ends, so the cycle it built is freed.
  std::weak_ptr<List> seen;
  {
    RenderBudget budget({});
    Value l = Value::new_list();
    l.list->push_back(l);
    seen = l.list;
  }
  EXPECT_TRUE(seen.expired());
}

TEST(JinjaBudget, IntegerArithmeticIsChecked) {
  expect_refused("{{ -9223372036854775807 - 1 - 1 }}", "integer overflow");
  expect_refused("{{ (-9223372036854775807 - 1) // -1 }}", "integer overflow");
  expect_refused("{{ 2 ** 64 }}", "integer overflow");
  expect_refused("{{ 3037000500 * 3037000500 }}", "integer overflow");
  expect_refused("{{ -(-9223372036854775807 - 1) }}", "integer overflow");
  expect_refused("{{ (-9223372036854775807 - 1) | abs }}", "integer overflow");
  expect_refused("{{ [9223372036854775807, 1] | sum }}", "integer overflow");
  expect_refused("{{ range(1e300) }}", "integer overflow");
  // Python's answers where 64 bits hold them.
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }} {{ (-9223372036854775807 - 1) is "
                   "divisibleby(-1) }}"),
            "0 True");
  EXPECT_EQ(render("{{ 2 ** 62 }} {{ (-2) ** 63 }} {{ -7 % 3 }} {{ 7 // -2 }}"),
            "4611686018427387904 -9223372036854775808 2 -4");
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 3) | list }}"),
            "[9223372036854775800, 9223372036854775803, 9223372036854775806]");
}

TEST(JinjaBudget, LoopsThatWouldPinACoreStopAtTheStepBudget) {
  // The two nested loops of 10^6 run out of bytes (the loop variables' records) first.
  expect_refused(
      "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
      "budget");
  // Work that allocates nothing per step: comparing two lists of 50,000 items, 1,000 times.
  expect_refused(
      "{% set a = range(50000) | list %}{% set b = range(50000) | list %}"
      "{% for i in range(1000) %}{% if a == b %}{% endif %}{% endfor %}",
      "steps");
  RenderLimits tight;
  tight.max_steps = 1000;
  expect_refused("{% for i in range(10000) %}{% endfor %}", "steps", tight);
  EXPECT_EQ(error_of("{% for i in range(100) %}{% endfor %}", tight), "");
}

TEST(JinjaBudget, DeadlineAndCancellation) {
  RenderLimits cancelled;
  cancelled.cancelled = [] { return true; };
  expect_refused("{% for i in range(100000) %}{% endfor %}", "cancelled", cancelled);
  EXPECT_EQ(error_of("{% for i in range(10) %}{% endfor %}", cancelled),
            "");  // polled every 1024 steps
  RenderLimits hurried;
  hurried.max_seconds = 0;
  expect_refused("{% for i in range(100000) %}{% endfor %}", "time budget", hurried);
}

TEST(JinjaBudget, LiteralsThatDoNotParseAreErrors) {
  expect_refused("{{ 99999999999999999999 }}", "does not fit in 64 bits");
  expect_refused("{{ '\\uZZZZ' }}", "bad \\u escape");
  expect_refused("{{ '\\u12' }}", "bad \\u escape");
  EXPECT_EQ(render("{{ 1e999 }} {{ 1e-999 }} {{ '\\u00e9' }}"), "inf 0.0 é");  // as Python
  EXPECT_EQ(render("{{ 'a\nb' | indent(-3, true) }}|{{ [1] | tojson(indent=-1) }}"),
            "a\nb|[\n1\n]");  // as Python
}

}  // namespace
}  // namespace r3::text::jinja
