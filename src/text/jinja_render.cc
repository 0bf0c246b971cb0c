// The chat-template renderer: walks the tree (text/jinja_syntax.h) over the context, every
// evaluation charged to the render's budget (text/jinja_budget.h); Template::render.
#include "text/jinja.h"

#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <set>

#include "core/error.h"
#include "text/jinja_budget.h"
#include "text/jinja_syntax.h"
#include "text/utf8.h"

namespace r3::text::jinja {

namespace {

// ---- evaluation ----

struct Scope {
  std::map<std::string, Value> vars;
  Scope* parent = nullptr;
  const Value* find(const std::string& n) const {
    for (const Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { Normal, Break, Continue };

std::vector<std::string> chars_of(const std::string& s) {
  charge_bytes(uint64_t(s.size()) * sizeof(std::string));  // a string per byte at most
  std::vector<std::string> out;
  for (std::string_view c : utf8_chars(s)) out.emplace_back(c);
  return out;
}

bool is_space_str(const std::string& c) {
  size_t n;
  return is_unicode_space(utf8_decode_one(c, 0, &n));
}

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<std::string> cs = chars_of(s);
  std::vector<std::string> set = chars.is_string() ? chars_of(chars.s) : std::vector<std::string>{};
  auto strip_it = [&](const std::string& c) {
    return chars.is_string() ? std::find(set.begin(), set.end(), c) != set.end() : is_space_str(c);
  };
  size_t b = 0, e = cs.size();
  while (left && b < e && strip_it(cs[b])) ++b;
  while (right && e > b && strip_it(cs[e - 1])) --e;
  std::string out;
  for (size_t k = b; k < e; ++k) out += cs[k];
  return out;
}

std::string map_case(const std::string& s, int mode) {  // 0 lower, 1 upper, 2 title, 3 capitalize
  std::string out;
  bool start = true;
  for (size_t i = 0; i < s.size();) {
    size_t n;
    const char32_t c = utf8_decode_one(s, i, &n);
    char32_t m = c;
    const bool alpha = utf8proc_category(utf8proc_int32_t(c)) <= UTF8PROC_CATEGORY_LO &&
                       utf8proc_category(utf8proc_int32_t(c)) >= UTF8PROC_CATEGORY_LU;
    if (mode == 0)
      m = char32_t(utf8proc_tolower(utf8proc_int32_t(c)));
    else if (mode == 1)
      m = char32_t(utf8proc_toupper(utf8proc_int32_t(c)));
    else if (mode == 2)
      m = char32_t(start ? utf8proc_totitle(utf8proc_int32_t(c))
                         : utf8proc_tolower(utf8proc_int32_t(c)));
    else
      m = char32_t(i == 0 ? utf8proc_toupper(utf8proc_int32_t(c))
                          : utf8proc_tolower(utf8proc_int32_t(c)));
    if (mode == 2) start = !alpha;
    out += utf8_encode(m);
    i += n;
  }
  return out;
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep.is_string()) {  // runs of whitespace, no empty pieces
    std::vector<std::string> cs = chars_of(s);
    std::string cur;
    bool in = false;
    for (size_t k = 0; k < cs.size(); ++k) {
      if (is_space_str(cs[k])) {
        if (in) {
          charge_bytes(sizeof(Value) + cur.size());
          out.push_back(cur);
          cur.clear();
          in = false;
          if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) {
            size_t r = k;
            while (r < cs.size() && is_space_str(cs[r])) ++r;
            std::string rest;
            for (; r < cs.size(); ++r) rest += cs[r];
            if (!rest.empty()) out.push_back(rest);
            return out;
          }
        }
      } else {
        cur += cs[k];
        in = true;
      }
    }
    if (in) out.push_back(cur);
    return out;
  }
  if (sep.s.empty()) throw Error("chat template: split with an empty separator");
  size_t at = 0;
  for (;;) {
    if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) break;
    const size_t j = s.find(sep.s, at);
    if (j == std::string::npos) break;
    charge_bytes(sizeof(Value) + j - at);
    out.push_back(s.substr(at, j - at));
    at = j + sep.s.size();
  }
  out.push_back(s.substr(at));
  return out;
}

int64_t py_len(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::String:  // code points: the bytes that do not continue a UTF-8 sequence
      return int64_t(std::count_if(v.s.begin(), v.s.end(), [](char c) {
        return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
      }));
    case Value::Kind::List:
      return int64_t(v.list->size());
    case Value::Kind::Dict:
      return int64_t(v.dict->size());
    case Value::Kind::Undefined:
      return 0;
    default:
      fail(line, "length of a value that has none");
  }
}

// The items a for loop (or a filter) walks: a list's elements, a dict's keys, a string's chars.
List iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::List:
      charge_bytes(v.list->size() * sizeof(Value));
      return *v.list;
    case Value::Kind::Dict: {
      charge_bytes(v.dict->size() * sizeof(Value));
      List keys;
      for (const auto& [k, x] : *v.dict) keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::String: {
      charge_bytes(v.s.size() * sizeof(Value));
      List cs;
      for (std::string& c : chars_of(v.s)) cs.push_back(Value::string(c));
      return cs;
    }
    case Value::Kind::Undefined:
      return {};
    default:
      fail(line, "cannot iterate over " + to_str(v));
  }
}

int64_t normalise_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

// Python's integers are unbounded; r3's are 64-bit, so a result that does not fit is an error
// (never a wrapped value or a trap).
[[noreturn]] void overflow(int line, const std::string& what) {
  fail(line, "integer overflow in " + what + " (r3's templates compute with 64-bit integers)");
}

// A number as an integer (bools count), for range(), indent widths and the int filter; floats
// are truncated as Python's int() does.
int64_t to_int(const Value& v, int line, const std::string& what) {
  if (v.kind == Value::Kind::Int) return v.i;
  if (v.kind == Value::Kind::Bool) return v.b;
  if (v.kind != Value::Kind::Float) fail(line, what + " needs a number, not " + to_str(v));
  if (!std::isfinite(v.f) || v.f >= 9.2233720368547758e18 || v.f < -9.2233720368547758e18)
    overflow(line, what);
  return int64_t(v.f);
}

int64_t int_pow(int64_t base, int64_t exp, int line) {
  int64_t r = 1;
  while (exp > 0) {
    if ((exp & 1) && __builtin_mul_overflow(r, base, &r)) overflow(line, "**");
    exp >>= 1;
    if (exp > 0 && __builtin_mul_overflow(base, base, &base)) overflow(line, "**");
  }
  return r;
}

Value arg(const Args& a, const Kwargs& kw, size_t pos, const char* name,
          Value dflt = Value::undefined()) {
  for (const auto& [k, v] : kw)
    if (k == name) return v;
  return pos < a.size() ? a[pos] : dflt;
}

class Renderer {
 public:
  Renderer(Scope* globals, RenderBudget& budget) : globals_(globals), budget_(budget) {}

  Flow exec(const std::vector<NodeP>& body, Scope& scope, std::string& out) {
    for (const NodeP& n : body) {
      const Flow f = exec(*n, scope, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Node& n, Scope& scope, std::string& out) {
    budget_.step(n.line);
    const DepthGuard depth(budget_);
    switch (n.kind) {
      case Node::Text:
        budget_.produce(n.text.size());
        out += n.text;
        return Flow::Normal;
      case Node::Output: {
        const std::string text = to_str(eval(*n.expr, scope));
        budget_.produce(text.size());
        out += text;
        return Flow::Normal;
      }
      case Node::Block:
        return exec(n.body, scope, out);
      case Node::If:
        for (const auto& [cond, body] : n.branches)
          if (eval(*cond, scope).truthy()) return exec(body, scope, out);
        return exec(n.else_body, scope, out);
      case Node::For: {
        List items = iterate(eval(*n.expr, scope), n.line);
        if (n.filter) {
          List kept;
          for (Value& it : items) {
            budget_.step(n.line);
            Scope s{{}, &scope};
            bind(n, it, s);
            if (eval(*n.filter, s).truthy()) kept.push_back(it);
          }
          items = std::move(kept);
        }
        if (items.empty()) return exec(n.else_body, scope, out);
        const int64_t len = int64_t(items.size());
        for (int64_t k = 0; k < len; ++k) {
          budget_.step(n.line);  // an iteration is a step even when its body is empty
          Scope s{{}, &scope};
          bind(n, items[size_t(k)], s);
          Dict loop = {
              {"index0", Value::integer(k)},
              {"index", Value::integer(k + 1)},
              {"revindex0", Value::integer(len - k - 1)},
              {"revindex", Value::integer(len - k)},
              {"first", Value::boolean(k == 0)},
              {"last", Value::boolean(k == len - 1)},
              {"length", Value::integer(len)},
              {"previtem", k > 0 ? items[size_t(k - 1)] : Value::undefined("previtem")},
              {"nextitem", k + 1 < len ? items[size_t(k + 1)] : Value::undefined("nextitem")}};
          s.vars["loop"] = Value::new_dict(std::move(loop));
          const Flow f = exec(n.body, s, out);
          if (f == Flow::Break) break;
        }
        return Flow::Normal;
      }
      case Node::Set: {
        Value v = eval(*n.expr, scope);
        if (!n.attr.empty()) {
          const Value* ns = scope.find(n.targets[0]);
          if (!ns || ns->kind != Value::Kind::Namespace)
            fail(n.line, "'" + n.targets[0] + "' is not a namespace (set " + n.targets[0] + "." +
                             n.attr + ")");
          ns->ns->attrs[n.attr] = std::move(v);
        } else if (n.targets.size() == 1) {
          scope.vars[n.targets[0]] = std::move(v);
        } else {
          List parts = iterate(v, n.line);
          if (parts.size() != n.targets.size()) fail(n.line, "cannot unpack " + to_str(v));
          for (size_t k = 0; k < parts.size(); ++k) scope.vars[n.targets[k]] = parts[k];
        }
        return Flow::Normal;
      }
      case Node::SetBlock: {
        std::string captured;
        exec(n.body, scope, captured);
        scope.vars[n.targets[0]] = Value::string(captured);
        return Flow::Normal;
      }
      case Node::Macro: {
        const Node* def = &n;
        Renderer* self = this;
        scope.vars[n.targets[0]] = Value::function([def, self](const Args& a, const Kwargs& kw) {
          Scope s{{}, self->globals_};
          for (size_t k = 0; k < def->params.size(); ++k) {
            const auto& [name, dflt] = def->params[k];
            Value v = arg(a, kw, k, name.c_str());
            if (v.is_undefined() && dflt) v = self->eval(*dflt, s);
            s.vars[name] = v;
          }
          std::string out;
          self->exec(def->body, s, out);
          return Value::string(out);
        });
        return Flow::Normal;
      }
      case Node::Break:
        return Flow::Break;
      case Node::Continue:
        return Flow::Continue;
    }
    return Flow::Normal;
  }

 private:
  void bind(const Node& n, const Value& item, Scope& s) {
    if (n.targets.size() == 1) {
      s.vars[n.targets[0]] = item;
      return;
    }
    List parts = iterate(item, n.line);
    if (parts.size() != n.targets.size())
      fail(n.line, "cannot unpack " + to_str(item) + " into the loop variables");
    for (size_t k = 0; k < parts.size(); ++k) s.vars[n.targets[k]] = parts[k];
  }

  // Every evaluation is a step at its line, one level deeper, and the bytes of the string it
  // yields (copies included: they cost the time and may be kept).
  Value eval(const Expr& e, Scope& scope) {
    budget_.step(e.line);
    const DepthGuard depth(budget_);
    Value v = evaluate(e, scope);
    if (v.kind == Value::Kind::String) budget_.produce(v.s.size());
    return v;
  }

  Value evaluate(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::Literal:
        return e.literal;
      case Expr::Name: {
        if (const Value* v = scope.find(e.name)) return *v;
        return Value::undefined(e.name);
      }
      case Expr::Attr:
        return attribute(eval(*e.args[0], scope), e.name, e.line);
      case Expr::Item: {
        const Value obj = eval(*e.args[0], scope);
        const Value key = eval(*e.args[1], scope);
        return item(obj, key, e.line);
      }
      case Expr::Slice:
        return slice(e, scope);
      case Expr::Call: {
        const Value f = eval(*e.args[0], scope);
        Args a;
        for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k], scope));
        Kwargs kw;
        for (const auto& [k, x] : e.kwargs) kw.emplace_back(k, eval(*x, scope));
        if (f.kind != Value::Kind::Function)
          fail(e.line, (f.is_undefined() ? "'" + f.undefined_name + "' is undefined"
                                         : to_str(f) + " is not callable"));
        return (*f.fn)(a, kw);
      }
      case Expr::Filter:
        return filter(e, scope);
      case Expr::Test: {
        const bool r = test(e, scope);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Unary: {
        const Value v = eval(*e.args[0], scope);
        if (e.name == "not") return Value::boolean(!v.truthy());
        if (!v.is_number()) fail(e.line, "unary " + e.name + " of a non-number");
        if (e.name == "+") return v;
        if (v.kind == Value::Kind::Float) return Value::number(-v.f);
        int64_t neg;
        if (__builtin_sub_overflow(int64_t(0), v.kind == Value::Kind::Bool ? int64_t(v.b) : v.i,
                                   &neg))
          overflow(e.line, "unary -");
        return Value::integer(neg);
      }
      case Expr::Binary:
        return binary(e, scope);
      case Expr::Cond:
        if (eval(*e.args[0], scope).truthy()) return eval(*e.args[1], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined();
      case Expr::ListLit: {
        List l;
        for (const ExprP& x : e.args) l.push_back(eval(*x, scope));
        return Value::new_list(std::move(l));
      }
      case Expr::DictLit: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          const Value key = eval(*e.args[k], scope);
          if (!key.is_string())
            fail(e.line, "dict keys must be strings in r3's chat template renderer");
          set_key(d, key.s, eval(*e.args[k + 1], scope));
        }
        return Value::new_dict(std::move(d));
      }
    }
    return Value::undefined();
  }

  // A filter or test node applied to values (map('filter'), selectattr(attr, 'test', ...)), so
  // those run through filter() and test() themselves.
  static ExprP applied(Expr::Kind kind, const std::string& name, const std::vector<Value>& args,
                       int line) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->name = name;
    e->line = line;
    for (const Value& v : args) {
      auto lit = std::make_shared<Expr>();
      lit->kind = Expr::Literal;
      lit->literal = v;
      e->args.push_back(lit);
    }
    return e;
  }

  static void set_key(Dict& d, const std::string& k, Value v) {
    for (auto& kv : d)
      if (kv.first == k) {
        kv.second = std::move(v);
        return;
      }
    d.emplace_back(k, std::move(v));
  }

  Value bound(std::function<Value(const Args&, const Kwargs&)> f) {
    return Value::function(std::move(f));
  }

  Value attribute(const Value& obj, const std::string& name, int line) {
    switch (obj.kind) {
      case Value::Kind::Undefined:
        fail(line, "'" + (obj.undefined_name.empty() ? std::string("value") : obj.undefined_name) +
                       "' is undefined (reading ." + name + ")");
      case Value::Kind::Namespace: {
        auto it = obj.ns->attrs.find(name);
        return it == obj.ns->attrs.end() ? Value::undefined(name) : it->second;
      }
      case Value::Kind::Dict: {
        if (name == "items")
          return bound([obj](const Args&, const Kwargs&) {
            List l;
            for (const auto& [k, v] : *obj.dict)
              l.push_back(Value::new_list({Value::string(k), v}));
            return Value::new_list(std::move(l));
          });
        if (name == "keys" || name == "values")
          return bound([obj, name](const Args&, const Kwargs&) {
            List l;
            for (const auto& [k, v] : *obj.dict) l.push_back(name == "keys" ? Value::string(k) : v);
            return Value::new_list(std::move(l));
          });
        if (name == "get")
          return bound([obj](const Args& a, const Kwargs& kw) {
            const Value key = arg(a, kw, 0, "key");
            const Value* v = key.is_string() ? obj.get(key.s) : nullptr;
            return v ? *v : arg(a, kw, 1, "default", Value::none());
          });
        const Value* v = obj.get(name);
        return v ? *v : Value::undefined(name);
      }
      case Value::Kind::String:
        return string_method(obj.s, name, line);
      case Value::Kind::List:
        if (name == "append")
          return bound([obj](const Args& a, const Kwargs&) {
            charge_bytes(sizeof(Value) + (a.empty() ? 0 : a[0].s.size()));
            obj.list->push_back(a.empty() ? Value::none() : a[0]);
            return Value::none();
          });
        return Value::undefined(name);
      default:
        return Value::undefined(name);
    }
  }

  Value string_method(const std::string& s, const std::string& name, int line) {
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return bound([s, start](const Args& a, const Kwargs&) {
        if (a.empty())
          throw Error("chat template: " + std::string(start ? "startswith" : "endswith") +
                      " needs an argument");
        List cands = a[0].kind == Value::Kind::List ? *a[0].list : List{a[0]};
        for (const Value& c : cands) {
          if (!c.is_string()) continue;
          if (c.s.size() <= s.size() &&
              (start ? s.compare(0, c.s.size(), c.s) == 0
                     : s.compare(s.size() - c.s.size(), c.s.size(), c.s) == 0))
            return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const bool l = name != "rstrip", r = name != "lstrip";
      return bound([s, l, r](const Args& a, const Kwargs& kw) {
        return Value::string(strip_chars(s, arg(a, kw, 0, "chars"), l, r));
      });
    }
    if (name == "split" || name == "rsplit") {
      if (name == "rsplit")
        fail(line, "str.rsplit is not supported by r3's chat template renderer");
      return bound([s](const Args& a, const Kwargs& kw) {
        const Value sep = arg(a, kw, 0, "sep");
        const Value max = arg(a, kw, 1, "maxsplit", Value::integer(-1));
        List l;
        for (std::string& p : py_split(s, sep.is_none() ? Value::undefined() : sep,
                                       max.is_number() ? int64_t(max.as_double()) : -1))
          l.push_back(Value::string(p));
        return Value::new_list(std::move(l));
      });
    }
    if (name == "replace")
      return bound([s](const Args& a, const Kwargs&) {
        if (a.size() < 2 || !a[0].is_string() || !a[1].is_string())
          throw Error("chat template: replace needs two strings");
        int64_t count = a.size() > 2 && a[2].is_number() ? int64_t(a[2].as_double()) : -1;
        std::string out;
        size_t at = 0;
        if (a[0].s.empty()) return Value::string(s);
        for (size_t j; count != 0 && (j = s.find(a[0].s, at)) != std::string::npos; --count) {
          charge_bytes(j - at + a[1].s.size());
          out += s.substr(at, j - at) + a[1].s;
          at = j + a[0].s.size();
        }
        return Value::string(out + s.substr(at));
      });
    for (auto [n, mode] : {std::pair{"lower", 0}, {"upper", 1}, {"title", 2}, {"capitalize", 3}})
      if (name == n)
        return bound(
            [s, m = mode](const Args&, const Kwargs&) { return Value::string(map_case(s, m)); });
    if (name == "join")
      return bound([s](const Args& a, const Kwargs&) {
        std::string out;
        List items = a.empty() ? List{} : iterate(a[0], 0);
        for (size_t k = 0; k < items.size(); ++k) {
          const std::string piece = (k ? s : "") + to_str(items[k]);
          charge_bytes(piece.size());
          out += piece;
        }
        return Value::string(out);
      });
    if (name == "find" || name == "count")
      return bound([s, name](const Args& a, const Kwargs&) {
        if (a.empty() || !a[0].is_string())
          throw Error("chat template: " + name + " needs a string");
        if (name == "count") {
          int64_t c = 0;
          for (size_t at = s.find(a[0].s); !a[0].s.empty() && at != std::string::npos;
               at = s.find(a[0].s, at + a[0].s.size()))
            ++c;
          return Value::integer(c);
        }
        const size_t at = s.find(a[0].s);
        return Value::integer(
            at == std::string::npos ? -1 : int64_t(utf8_chars(s.substr(0, at)).size()));
      });
    fail(line, "str." + name + " is not supported by r3's chat template renderer");
  }

  Value item(const Value& obj, const Value& key, int line) {
    if (obj.kind == Value::Kind::Dict) {
      if (!key.is_string()) return Value::undefined();
      const Value* v = obj.get(key.s);
      return v ? *v : Value::undefined(key.s);
    }
    if (obj.kind == Value::Kind::List || obj.kind == Value::Kind::String) {
      if (key.kind != Value::Kind::Int) {
        if (key.is_string()) return attribute(obj, key.s, line);
        fail(line, "list index must be an integer");
      }
      if (obj.kind == Value::Kind::List) {
        const int64_t i = normalise_index(key.i, int64_t(obj.list->size()));
        return i >= 0 && i < int64_t(obj.list->size()) ? (*obj.list)[size_t(i)]
                                                       : Value::undefined();
      }
      std::vector<std::string> cs = chars_of(obj.s);
      const int64_t i = normalise_index(key.i, int64_t(cs.size()));
      return i >= 0 && i < int64_t(cs.size()) ? Value::string(cs[size_t(i)]) : Value::undefined();
    }
    if (obj.kind == Value::Kind::Namespace && key.is_string()) return attribute(obj, key.s, line);
    if (obj.is_undefined()) fail(line, "'" + obj.undefined_name + "' is undefined (subscript)");
    return Value::undefined();
  }

  Value slice(const Expr& e, Scope& scope) {
    const Value obj = eval(*e.args[0], scope);
    auto opt = [&](size_t k) -> std::optional<int64_t> {
      if (!e.args[k]) return std::nullopt;
      const Value v = eval(*e.args[k], scope);
      if (v.is_none()) return std::nullopt;
      if (v.kind != Value::Kind::Int) fail(e.line, "slice indices must be integers");
      return v.i;
    };
    const std::optional<int64_t> start = opt(1), stop = opt(2), step_opt = opt(3);
    const int64_t step = step_opt.value_or(1);
    if (step == 0) fail(e.line, "slice step cannot be zero");
    List items;
    std::vector<std::string> cs;
    int64_t n;
    if (obj.kind == Value::Kind::List)
      n = int64_t(obj.list->size()), budget_.produce(obj.list->size() * sizeof(Value));
    else if (obj.kind == Value::Kind::String)
      cs = chars_of(obj.s), n = int64_t(cs.size());
    else
      fail(e.line, "cannot slice " + to_str(obj));
    // Python's slice.indices.
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt, bool is_start) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      (void)is_start;
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t b = clamp(start, step > 0 ? 0 : n - 1, true),
                  en = clamp(stop, step > 0 ? n : -1, false);
    std::string str;
    for (int64_t k = b; step > 0 ? k < en : k > en; k += step) {
      if (obj.kind == Value::Kind::List)
        items.push_back((*obj.list)[size_t(k)]);
      else
        str += cs[size_t(k)];
    }
    return obj.kind == Value::Kind::List ? Value::new_list(std::move(items)) : Value::string(str);
  }

  Value binary(const Expr& e, Scope& scope) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.args[0], scope);
      return a.truthy() ? eval(*e.args[1], scope) : a;
    }
    if (op == "or") {
      Value a = eval(*e.args[0], scope);
      return a.truthy() ? a : eval(*e.args[1], scope);
    }
    const Value a = eval(*e.args[0], scope), b = eval(*e.args[1], scope);
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "in" || op == "not in") {
      bool in = false;
      if (b.is_string()) {
        if (!a.is_string()) fail(e.line, "'in <string>' needs a string on the left");
        in = b.s.find(a.s) != std::string::npos;
      } else if (b.kind == Value::Kind::List) {
        for (const Value& x : *b.list) in = in || equal(a, x);
      } else if (b.kind == Value::Kind::Dict) {
        in = a.is_string() && b.get(a.s);
      } else if (!b.is_undefined()) {
        fail(e.line, "'in' needs a string, list or dict on the right");
      }
      return Value::boolean(op == "in" ? in : !in);
    }
    if (op == "~") return Value::string(to_str(a) + to_str(b));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c;
      if (a.is_number() && b.is_number())
        c = a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double() ? 1 : 0;
      else if (a.is_string() && b.is_string())
        c = a.s.compare(b.s);
      else
        fail(e.line, "cannot compare " + to_str(a) + " and " + to_str(b));
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
      if (a.kind == Value::Kind::List && b.kind == Value::Kind::List) {
        budget_.produce((a.list->size() + b.list->size()) * sizeof(Value));
        List l = *a.list;
        l.insert(l.end(), b.list->begin(), b.list->end());
        return Value::new_list(std::move(l));
      }
    }
    if (op == "*" && ((a.is_string() && b.kind == Value::Kind::Int) ||
                      (b.is_string() && a.kind == Value::Kind::Int))) {
      const std::string& s = a.is_string() ? a.s : b.s;
      const int64_t times = std::max<int64_t>(0, a.is_string() ? b.i : a.i);
      uint64_t bytes;
      if (__builtin_mul_overflow(uint64_t(s.size()), uint64_t(times), &bytes)) bytes = UINT64_MAX;
      budget_.produce(bytes);  // refused before anything is allocated
      std::string out;
      out.reserve(size_t(bytes));
      for (int64_t k = 0; k < times; ++k) out += s;
      return Value::string(out);
    }
    if (!a.is_number() || !b.is_number())
      fail(e.line, "unsupported operands for " + op + ": " + to_str(a) + " and " + to_str(b) +
                       (a.is_undefined() ? " ('" + a.undefined_name + "' is undefined)" : "") +
                       (b.is_undefined() ? " ('" + b.undefined_name + "' is undefined)" : ""));
    const bool ints = a.kind != Value::Kind::Float && b.kind != Value::Kind::Float;
    const int64_t ai = a.kind == Value::Kind::Bool ? a.b : a.i,
                  bi = b.kind == Value::Kind::Bool ? b.b : b.i;
    const double x = a.as_double(), y = b.as_double();
    int64_t r;
    if (op == "+") {
      if (!ints) return Value::number(x + y);
      if (__builtin_add_overflow(ai, bi, &r)) overflow(e.line, "+");
      return Value::integer(r);
    }
    if (op == "-") {
      if (!ints) return Value::number(x - y);
      if (__builtin_sub_overflow(ai, bi, &r)) overflow(e.line, "-");
      return Value::integer(r);
    }
    if (op == "*") {
      if (!ints) return Value::number(x * y);
      if (__builtin_mul_overflow(ai, bi, &r)) overflow(e.line, "*");
      return Value::integer(r);
    }
    if (op == "/") {
      if (y == 0) fail(e.line, "division by zero");
      return Value::number(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) fail(e.line, "division by zero");
      if (ints) {
        if (ai == INT64_MIN && bi == -1) {
          if (op == "%") return Value::integer(0);
          overflow(e.line, "//");
        }
        int64_t q = ai / bi, rem = ai % bi;
        if (rem != 0 && ((rem < 0) != (bi < 0))) --q, rem += bi;
        return Value::integer(op == "//" ? q : rem);
      }
      const double q = std::floor(x / y);
      return Value::number(op == "//" ? q : x - q * y);
    }
    if (op == "**")
      return ints && bi >= 0 ? Value::integer(int_pow(ai, bi, e.line))
                             : Value::number(std::pow(x, y));
    fail(e.line, "unknown operator " + op);
  }

  bool test(const Expr& e, Scope& scope) {
    const Value v = eval(*e.args[0], scope);
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k], scope));
    const std::string& t = e.name;
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.is_none();
    if (t == "boolean") return v.kind == Value::Kind::Bool;
    if (t == "true") return v.kind == Value::Kind::Bool && v.b;
    if (t == "false") return v.kind == Value::Kind::Bool && !v.b;
    if (t == "integer") return v.kind == Value::Kind::Int;
    if (t == "float") return v.kind == Value::Kind::Float;
    if (t == "number") return v.is_number();
    if (t == "string") return v.is_string();
    if (t == "mapping") return v.kind == Value::Kind::Dict;
    if (t == "iterable")
      return v.kind == Value::Kind::List || v.kind == Value::Kind::Dict || v.is_string();
    if (t == "sequence")
      return v.kind == Value::Kind::List || v.kind == Value::Kind::Dict || v.is_string();
    if (t == "callable") return v.kind == Value::Kind::Function;
    if (t == "lower") return v.is_string() && map_case(v.s, 0) == v.s;
    if (t == "upper") return v.is_string() && map_case(v.s, 1) == v.s;
    if (a.empty() && t != "odd" && t != "even") fail(e.line, "test '" + t + "' needs an argument");
    if (t == "odd" || t == "even") {
      if (v.kind != Value::Kind::Int) fail(e.line, "test '" + t + "' of a non-integer");
      return (v.i % 2 != 0) == (t == "odd");
    }
    if (t == "divisibleby")  // x % -1 is 0 for every x (INT64_MIN % -1 traps in C++)
      return v.kind == Value::Kind::Int && a[0].kind == Value::Kind::Int && a[0].i &&
             (a[0].i == -1 || v.i % a[0].i == 0);
    if (t == "eq" || t == "equalto" || t == "sameas") return equal(v, a[0]);
    if (t == "ne") return !equal(v, a[0]);
    if (t == "in") {
      const Value& b = a[0];
      if (b.is_string()) return v.is_string() && b.s.find(v.s) != std::string::npos;
      if (b.kind == Value::Kind::List)
        return std::any_of(b.list->begin(), b.list->end(),
                           [&](const Value& x) { return equal(v, x); });
      if (b.kind == Value::Kind::Dict) return v.is_string() && b.get(v.s);
      return false;
    }
    if (!v.is_number() || !a[0].is_number()) fail(e.line, "test '" + t + "' needs numbers");
    const double x = v.as_double(), y = a[0].as_double();
    if (t == "lt") return x < y;
    if (t == "le") return x <= y;
    if (t == "gt") return x > y;
    return x >= y;  // ge
  }

  Value filter(const Expr& e, Scope& scope) {
    const Value v = eval(*e.args[0], scope);
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k], scope));
    Kwargs kw;
    for (const auto& [k, x] : e.kwargs) kw.emplace_back(k, eval(*x, scope));
    const std::string& f = e.name;
    const int line = e.line;
    if (f == "trim")
      return Value::string(strip_chars(to_str(v), arg(a, kw, 0, "chars"), true, true));
    if (f == "length" || f == "count") return Value::integer(py_len(v, line));
    if (f == "string") return Value::string(to_str(v));
    if (f == "safe") return v;
    if (f == "upper") return Value::string(map_case(to_str(v), 1));
    if (f == "lower") return Value::string(map_case(to_str(v), 0));
    if (f == "title") return Value::string(map_case(to_str(v), 2));
    if (f == "capitalize") return Value::string(map_case(to_str(v), 3));
    if (f == "tojson") {
      const Value ind = arg(a, kw, 0, "indent", Value::none());
      const Value sort = arg(a, kw, 3, "sort_keys", Value::boolean(false));
      const Value seps = arg(a, kw, 2, "separators", Value::none());
      std::string item_sep = ", ", key_sep = ": ";
      if (seps.kind == Value::Kind::List && seps.list->size() == 2)
        item_sep = to_str((*seps.list)[0]), key_sep = to_str((*seps.list)[1]);
      else if (ind.is_number())
        item_sep = ",";
      std::optional<int> indent;  // json.dumps: a negative indent is newlines without spaces
      if (ind.is_number())
        indent = int(std::clamp<int64_t>(to_int(ind, line, "tojson indent"), -1, INT32_MAX));
      std::string out = to_json(v, indent, sort.truthy(), item_sep, key_sep);
      return Value::string(out);
    }
    if (f == "default" || f == "d") {
      const bool boolean = arg(a, kw, 1, "boolean", Value::boolean(false)).truthy();
      if (v.is_undefined() || (boolean && !v.truthy()))
        return arg(a, kw, 0, "default_value", Value::string(""));
      return v;
    }
    if (f == "first" || f == "last") {
      List items = iterate(v, line);
      if (items.empty()) return Value::undefined();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "join") {
      const Value sep = arg(a, kw, 0, "d", Value::string(""));
      const Value attr = arg(a, kw, 1, "attribute");
      std::string out;
      const std::string sep_text = to_str(sep);
      List items = iterate(v, line);
      for (size_t k = 0; k < items.size(); ++k) {
        Value x = attr.is_string() ? attribute(items[k], attr.s, line) : items[k];
        const std::string piece = (k ? sep_text : "") + to_str(x);
        budget_.produce(piece.size());
        out += piece;
      }
      return Value::string(out);
    }
    if (f == "items") {
      if (v.kind != Value::Kind::Dict) {
        if (v.is_undefined()) return Value::new_list();
        fail(line, "items of a non-dict");
      }
      List l;
      for (const auto& [k, x] : *v.dict) l.push_back(Value::new_list({Value::string(k), x}));
      return Value::new_list(std::move(l));
    }
    if (f == "list") return Value::new_list(iterate(v, line));
    if (f == "reverse") {
      if (v.is_string()) {
        std::vector<std::string> cs = chars_of(v.s);
        std::string out;
        for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
        return Value::string(out);
      }
      List l = iterate(v, line);
      std::reverse(l.begin(), l.end());
      return Value::new_list(std::move(l));
    }
    if (f == "replace") {
      if (a.size() < 2) fail(line, "replace needs two arguments");
      return string_method(to_str(v), "replace", line).fn->operator()(a, {});
    }
    if (f == "map" || f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      List items = iterate(v, line), out;
      const Value attr = f == "map" ? arg(a, kw, 99, "attribute") : Value::undefined();
      for (const Value& x : items) {
        if (f == "map") {
          if (attr.is_string())
            out.push_back(attribute(x, attr.s, line));
          else if (!a.empty() && a[0].is_string()) {
            if (!kFilters.count(a[0].s)) fail(line, "filter '" + a[0].s + "' is not supported");
            out.push_back(filter(*applied(Expr::Filter, a[0].s, {x}, line), scope));
          } else
            fail(line, "map needs attribute= or a filter name");
          continue;
        }
        const bool by_attr = f == "selectattr" || f == "rejectattr";
        if (by_attr && (a.empty() || !a[0].is_string())) fail(line, f + " needs an attribute name");
        const Value subject = by_attr ? attribute(x, a[0].s, line) : x;
        const size_t ti = by_attr ? 1 : 0;
        bool ok;
        if (a.size() <= ti)
          ok = subject.truthy();
        else {
          if (!a[ti].is_string() || !kTests.count(a[ti].s)) fail(line, f + ": unsupported test");
          std::vector<Value> test_args = {subject};
          test_args.insert(test_args.end(), a.begin() + long(ti) + 1, a.end());
          ok = test(*applied(Expr::Test, a[ti].s, test_args, line), scope);
        }
        if (ok == (f == "selectattr" || f == "select")) out.push_back(x);
      }
      return Value::new_list(std::move(out));
    }
    if (f == "int") {
      if (v.is_number()) return Value::integer(to_int(v, line, "int"));
      if (v.is_string()) {
        try {
          return Value::integer(std::stoll(v.s));
        } catch (...) {
        }
      }
      return arg(a, kw, 0, "default", Value::integer(0));
    }
    if (f == "float") {
      if (v.is_number()) return Value::number(v.as_double());
      if (v.is_string()) {
        try {
          return Value::number(std::stod(v.s));
        } catch (...) {
        }
      }
      return arg(a, kw, 0, "default", Value::number(0));
    }
    if (f == "abs") {
      if (!v.is_number()) fail(line, "abs of a non-number");
      if (v.kind == Value::Kind::Float) return Value::number(std::fabs(v.f));
      const int64_t i = to_int(v, line, "abs");
      if (i == INT64_MIN) overflow(line, "abs");
      return Value::integer(i < 0 ? -i : i);
    }
    if (f == "round") {
      const int prec = int(arg(a, kw, 0, "precision", Value::integer(0)).as_double());
      const double m = std::pow(10.0, prec);
      return Value::number(std::nearbyint(v.as_double() * m) / m);
    }
    if (f == "escape" || f == "e") {
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out += c;
        }
      }
      return Value::string(out);
    }
    if (f == "indent") {
      // Python's " " * width: a negative width indents by nothing.
      const int64_t width =
          std::max<int64_t>(0, to_int(arg(a, kw, 0, "width", Value::integer(4)), line, "indent"));
      const bool first = arg(a, kw, 1, "first", Value::boolean(false)).truthy();
      const bool blank = arg(a, kw, 2, "blank", Value::boolean(false)).truthy();
      budget_.produce(uint64_t(width));
      const std::string pad(size_t(width), ' ');
      std::string s = to_str(v), out;
      size_t at = 0;
      bool is_first = true;
      while (at <= s.size()) {
        size_t nl = s.find('\n', at);
        std::string ln = s.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
        budget_.produce(pad.size() + ln.size() + 1);
        if ((is_first && first) || (!is_first && (blank || !ln.empty()))) out += pad;
        out += ln;
        if (nl == std::string::npos) break;
        out += '\n';
        at = nl + 1;
        is_first = false;
      }
      return Value::string(out);
    }
    if (f == "wordcount")
      return Value::integer(int64_t(py_split(to_str(v), Value::undefined(), -1).size()));
    if (f == "unique") {
      List out;
      for (const Value& x : iterate(v, line))
        if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equal(x, y); }))
          out.push_back(x);
      return Value::new_list(std::move(out));
    }
    if (f == "sum") {
      Value acc = Value::integer(0);
      for (const Value& x : iterate(v, line)) {
        if (!x.is_number()) fail(line, "sum of non-numbers");
        if (acc.kind == Value::Kind::Int && x.kind == Value::Kind::Int) {
          if (__builtin_add_overflow(acc.i, x.i, &acc.i)) overflow(line, "sum");
        } else {
          acc = Value::number(acc.as_double() + x.as_double());
        }
      }
      return acc;
    }
    fail(line,
         "filter '" + f +
             "' is not supported by r3's chat template renderer");  // kFilters lists only the above
  }

  Scope* globals_;
  RenderBudget& budget_;
};

}  // namespace

namespace {
// The context copied into the render's own containers, so the budget owns every container a
// template can reach (a template may append to messages) and the caller's values stay as given.
Value owned_copy(const Value& v, int depth) {
  if (v.kind != Value::Kind::List && v.kind != Value::Kind::Dict) return v;
  if (depth > kMaxValueDepth)
    throw Error("chat template: a value nested deeper than " + std::to_string(kMaxValueDepth) +
                " levels");
  if (v.kind == Value::Kind::List) {
    List l;
    l.reserve(v.list->size());
    for (const Value& x : *v.list) l.push_back(owned_copy(x, depth + 1));
    return Value::new_list(std::move(l));
  }
  Dict d;
  d.reserve(v.dict->size());
  for (const auto& [k, x] : *v.dict) d.emplace_back(k, owned_copy(x, depth + 1));
  return Value::new_dict(std::move(d));
}
}  // namespace

std::string Template::render(const Dict& context, const RenderLimits& limits) const {
  // Copied inside the budget: the render owns its values, whatever the caller's hold.
  return render_building_context(
      [&context] {
        Dict copy;
        for (const auto& [k, v] : context) copy.emplace_back(k, owned_copy(v, 0));
        return copy;
      },
      limits);
}

std::string Template::render_building_context(const std::function<Dict()>& make_context,
                                              const RenderLimits& limits) const {
  RenderBudget budget(limits);
  Scope globals;
  globals.vars["raise_exception"] = Value::function([](const Args& a, const Kwargs&) -> Value {
    throw Error("chat template raised an exception: " + (a.empty() ? std::string() : to_str(a[0])));
  });
  globals.vars["namespace"] = Value::function([](const Args& a, const Kwargs& kw) {
    Value v = Value::new_namespace();
    if (!a.empty() && a[0].kind == Value::Kind::Dict)
      for (const auto& [k, x] : *a[0].dict) v.ns->attrs[k] = x;
    for (const auto& [k, x] : kw) v.ns->attrs[k] = x;
    return v;
  });
  globals.vars["range"] = Value::function([&budget](const Args& a, const Kwargs&) {
    const int line = budget.line();
    int64_t start = 0, stop = 0, step = 1;
    if (a.size() == 1)
      stop = to_int(a[0], line, "range");
    else if (a.size() >= 2)
      start = to_int(a[0], line, "range"), stop = to_int(a[1], line, "range");
    if (a.size() >= 3) step = to_int(a[2], line, "range");
    if (step == 0) fail(line, "range() step must not be zero");
    // The length first (in 128 bits: stop - start can overflow 64), refused before allocating.
    const __int128 span = step > 0 ? __int128(stop) - start : __int128(start) - stop;
    const __int128 count = span <= 0 ? 0
                                     : (span + (step > 0 ? step : -__int128(step)) - 1) /
                                           (step > 0 ? step : -__int128(step));
    budget.produce(count > __int128(INT64_MAX / int64_t(sizeof(Value)))
                       ? UINT64_MAX
                       : uint64_t(count) * sizeof(Value));
    List l;
    l.reserve(size_t(count));
    for (__int128 k = 0; k < count; ++k) l.push_back(Value::integer(int64_t(start + k * step)));
    return Value::new_list(std::move(l));
  });
  globals.vars["dict"] = Value::function([](const Args&, const Kwargs& kw) {
    Dict d(kw.begin(), kw.end());
    return Value::new_dict(std::move(d));
  });
  globals.vars["strftime_now"] = Value::function([](const Args& a, const Kwargs&) {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t n =
        std::strftime(buf, sizeof buf, a.empty() ? "%Y-%m-%d" : to_str(a[0]).c_str(), &tm);
    return Value::string(std::string(buf, n));
  });
  Scope top{{}, &globals};
  for (auto& [k, v] : make_context()) top.vars[k] = std::move(v);
  std::string out;
  Renderer r(&globals, budget);
  r.exec(root_->body, top, out);
  return out;
}

}  // namespace r3::text::jinja
