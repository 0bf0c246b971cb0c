// The values a chat template computes with, as Jinja (on Python) has them: undefined, None,
// booleans, ints, floats, strings, lists, dicts that keep insertion order, namespaces, and
// callables (macros, globals, bound methods). Printing and tojson follow Python exactly (float
// repr, True/None, json.dumps with ensure_ascii=False), since rendered prompts must be byte for
// byte what Hugging Face's apply_chat_template gives.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace r3::text::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(const Args&, const Kwargs&)>;

struct Namespace {
  std::map<std::string, Value> attrs;
};

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;  // shared, mutable: Python's reference semantics
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Namespace> ns;
  std::shared_ptr<Function> fn;
  std::string undefined_name;  // what was looked up, for "x is undefined" errors

  static Value none() {
    Value v;
    v.kind = Kind::None;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.kind = Kind::Bool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.kind = Kind::Int;
    v.i = x;
    return v;
  }
  static Value number(double x) {
    Value v;
    v.kind = Kind::Float;
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v;
    v.kind = Kind::String;
    v.s = std::move(x);
    return v;
  }
  // Containers made during a render belong to its RenderBudget (text/jinja_budget.h).
  static Value new_list(List x = {});
  static Value new_dict(Dict x = {});
  static Value new_namespace();
  static Value function(Function f) {
    Value v;
    v.kind = Kind::Function;
    v.fn = std::make_shared<Function>(std::move(f));
    return v;
  }
  static Value undefined(std::string name = {}) {
    Value v;
    v.undefined_name = std::move(name);
    return v;
  }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool truthy() const;
  double as_double() const;
  // A dict's entry, or nullptr.
  const Value* get(const std::string& key) const;
};

// From JSON, object keys in the document's order (ordered_json).
Value from_json(const nlohmann::ordered_json& j);
// str(value) as Jinja prints it ({{ x }}): Python's str, "" for undefined; a list or dict that
// contains itself prints as Python does ([[...]]).
std::string to_str(const Value& v);
// Python's repr of a float ("1.0", "1e-05", "1e+16", "inf").
std::string python_float(double x);
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...), as the
// tojson filter of Hugging Face's chat-template environment does (a value that contains itself is
// an error, as Python's "Circular reference detected"). A negative indent is Python's: newlines
// without spaces.
std::string to_json(const Value& v, std::optional<int> indent = std::nullopt,
                    bool sort_keys = false, const std::string& item_sep = ", ",
                    const std::string& key_sep = ": ");
// Python's == between two values (a container equals itself without a look inside). Values
// nested deeper than kMaxValueDepth are an r3::Error in these three.
bool equal(const Value& a, const Value& b);

}  // namespace r3::text::jinja
