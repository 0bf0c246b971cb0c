#include "text/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "text/jinja_budget.h"
#include "text/utf8.h"

namespace r3::text::jinja {

bool Value::truthy() const {
  switch (kind) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
      return b;
    case Kind::Int:
      return i != 0;
    case Kind::Float:
      return f != 0;
    case Kind::String:
      return !s.empty();
    case Kind::List:
      return !list->empty();
    case Kind::Dict:
      return !dict->empty();
    case Kind::Namespace:
    case Kind::Function:
      return true;
  }
  return false;
}

double Value::as_double() const {
  if (kind == Kind::Int) return double(i);
  if (kind == Kind::Float) return f;
  if (kind == Kind::Bool) return b ? 1 : 0;
  throw Error("chat template: expected a number");
}

const Value* Value::get(const std::string& key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}

namespace {
// A container made while a render runs belongs to its budget (emptied when the render ends).
template <typename C>
std::shared_ptr<C> adopted(std::shared_ptr<C> c) {
  if (RenderBudget* b = RenderBudget::active()) b->adopt(c);
  return c;
}
}  // namespace

Value Value::new_list(List x) {
  Value v;
  v.kind = Kind::List;
  v.list = adopted(std::make_shared<List>(std::move(x)));
  return v;
}

Value Value::new_dict(Dict x) {
  Value v;
  v.kind = Kind::Dict;
  v.dict = adopted(std::make_shared<Dict>(std::move(x)));
  return v;
}

Value Value::new_namespace() {
  Value v;
  v.kind = Kind::Namespace;
  v.ns = adopted(std::make_shared<Namespace>());
  return v;
}

// Every value is charged to the active render's budget before it is made (a string its bytes, a
// container its slots), so a request's JSON becomes values only within the budget: a Value is
// ~150 bytes where the JSON spends 2 ("0,"), and a 16 MB body of small values would otherwise
// become gigabytes before the template ran.
Value from_json(const nlohmann::ordered_json& j) {
  charge_work(1);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: {
      const auto& s = j.get_ref<const std::string&>();
      charge_bytes(s.size());
      return Value::string(s);
    }
    case nlohmann::ordered_json::value_t::array: {
      charge_bytes(sizeof(std::shared_ptr<List>) + j.size() * sizeof(Value));
      auto l = std::make_shared<List>();
      l->reserve(j.size());
      for (const auto& x : j) l->push_back(from_json(x));
      Value v;
      v.kind = Value::Kind::List;
      if (RenderBudget* b = RenderBudget::active()) b->own(l);
      v.list = std::move(l);
      return v;
    }
    case nlohmann::ordered_json::value_t::object: {
      charge_bytes(sizeof(std::shared_ptr<Dict>) + j.size() * sizeof(Dict::value_type));
      auto d = std::make_shared<Dict>();
      d->reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        charge_bytes(it.key().size());
        d->emplace_back(it.key(), from_json(it.value()));
      }
      Value v;
      v.kind = Value::Kind::Dict;
      if (RenderBudget* b = RenderBudget::active()) b->own(d);
      v.dict = std::move(d);
      return v;
    }
    default:
      return Value::none();
  }
}

std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  // The shortest digits that read back as x, then Python's layout: positional for exponents in
  // [-4, 16), else d.ddde+XX.
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;  // [-]d.ddde[+-]XX
  const size_t e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string mant = s.substr(0, e);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (int(digits.size()) <= exp + 1)
        out = digits + std::string(size_t(exp + 1 - int(digits.size())), '0') + ".0";
      else
        out = digits.substr(0, size_t(exp + 1)) + "." + digits.substr(size_t(exp + 1));
    } else {
      out = "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

namespace {
std::string py_repr_string(const std::string& s) {
  // Python's repr of a str: single quotes unless the text has ' and no ".
  const bool use_double = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = use_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == q)
      out += std::string("\\") + char(c);
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else
      out += char(c);
  }
  return out + q;
}

// An error about a value, with the template line when a render is running.
[[noreturn]] void value_error(const std::string& what) {
  if (RenderBudget* b = RenderBudget::active()) b->exceeded(what);
  throw Error("chat template: " + what);
}

void check_depth(int depth) {
  if (depth > kMaxValueDepth)
    value_error("a value nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
}

// Python's str (top level) or repr (inside a container); `open` holds the containers being
// printed, so one that contains itself prints as [...] or {...}, as Python does.
void print(const Value& v, bool top, std::vector<const void*>& open, std::string& out) {
  auto put = [&out](const std::string& piece) {
    charge_bytes(piece.size());
    out += piece;
  };
  switch (v.kind) {
    case Value::Kind::Undefined:
      return;
    case Value::Kind::None:
      return put("None");
    case Value::Kind::Bool:
      return put(v.b ? "True" : "False");
    case Value::Kind::Int:
      return put(std::to_string(v.i));
    case Value::Kind::Float:
      return put(python_float(v.f));
    case Value::Kind::String:
      return put(top ? v.s : py_repr_string(v.s));
    case Value::Kind::Namespace:
      return put("<Namespace>");
    case Value::Kind::Function:
      return put("<function>");
    case Value::Kind::List:
    case Value::Kind::Dict:
      break;
  }
  const bool list = v.kind == Value::Kind::List;
  const void* id =
      list ? static_cast<const void*>(v.list.get()) : static_cast<const void*>(v.dict.get());
  if (std::find(open.begin(), open.end(), id) != open.end()) return put(list ? "[...]" : "{...}");
  check_depth(int(open.size()) + 1);
  open.push_back(id);
  put(list ? "[" : "{");
  const size_t n = list ? v.list->size() : v.dict->size();
  for (size_t k = 0; k < n; ++k) {
    if (k) put(", ");
    if (list) {
      print((*v.list)[k], false, open, out);
    } else {
      put(py_repr_string((*v.dict)[k].first) + ": ");
      print((*v.dict)[k].second, false, open, out);
    }
  }
  put(list ? "]" : "}");
  open.pop_back();
}

void json_string(const std::string& s, std::string& out) {
  charge_bytes(s.size() + 2);
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else
          out += char(c);
    }
  }
  out += '"';
}

void dump(const Value& v, std::optional<int> indent, bool sort_keys, const std::string& item_sep,
          const std::string& key_sep, int depth, std::vector<const void*>& open, std::string& out) {
  auto newline = [&](int d) {
    const uint64_t spaces = uint64_t(std::max(0, *indent)) * uint64_t(d);
    charge_bytes(spaces + 1);
    out += '\n';
    out.append(size_t(spaces), ' ');
  };
  auto enter = [&](const void* id) {
    if (std::find(open.begin(), open.end(), id) != open.end())
      value_error("tojson of a value that contains itself (circular reference)");
    check_depth(depth + 1);
    open.push_back(id);
  };
  charge_bytes(item_sep.size() + key_sep.size() + 8);
  // With indent, Python puts items on their own lines and drops the item separator's trailing
  // space.
  const std::string sep = indent ? (item_sep == ", " ? "," : item_sep) : item_sep;
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      out += "null";
      break;
    case Value::Kind::Bool:
      out += v.b ? "true" : "false";
      break;
    case Value::Kind::Int:
      out += std::to_string(v.i);
      break;
    case Value::Kind::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float(v.f);
      break;
    case Value::Kind::String:
      json_string(v.s, out);
      break;
    case Value::Kind::List:
      if (v.list->empty()) {
        out += "[]";
        break;
      }
      enter(v.list.get());
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += sep;
        if (indent) newline(depth + 1);
        dump((*v.list)[k], indent, sort_keys, item_sep, key_sep, depth + 1, open, out);
      }
      if (indent) newline(depth);
      out += ']';
      open.pop_back();
      break;
    case Value::Kind::Dict: {
      if (v.dict->empty()) {
        out += "{}";
        break;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      enter(v.dict.get());
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += sep;
        if (indent) newline(depth + 1);
        json_string(items[k]->first, out);
        out += key_sep;
        dump(items[k]->second, indent, sort_keys, item_sep, key_sep, depth + 1, open, out);
      }
      if (indent) newline(depth);
      out += '}';
      open.pop_back();
      break;
    }
    case Value::Kind::Namespace:
    case Value::Kind::Function:
      throw Error("chat template: tojson of a value JSON cannot hold");
  }
}
}  // namespace

std::string to_str(const Value& v) {
  if (v.kind == Value::Kind::String) return v.s;
  std::string out;
  std::vector<const void*> open;
  print(v, true, open, out);
  return out;
}

std::string to_json(const Value& v, std::optional<int> indent, bool sort_keys,
                    const std::string& item_sep, const std::string& key_sep) {
  std::string out;
  std::vector<const void*> open;
  dump(v, indent, sort_keys, item_sep, key_sep, 0, open, out);
  return out;
}

namespace {
bool equal_at(const Value& a, const Value& b, int depth) {
  if (a.is_number() && b.is_number()) return a.as_double() == b.as_double();
  if (a.kind != b.kind)
    return (a.is_undefined() || a.is_none()) && (b.is_undefined() || b.is_none()) &&
           a.kind == b.kind;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::String:
      return a.s == b.s;
    case Value::Kind::List:
      if (a.list == b.list) return true;  // Python compares a container's items by identity first
      if (a.list->size() != b.list->size()) return false;
      check_depth(depth + 1);
      charge_work(a.list->size());
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal_at((*a.list)[k], (*b.list)[k], depth + 1)) return false;
      return true;
    case Value::Kind::Dict:
      if (a.dict == b.dict) return true;
      if (a.dict->size() != b.dict->size()) return false;
      check_depth(depth + 1);
      charge_work(a.dict->size() * a.dict->size());  // each key looked up by a scan
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.get(k);
        if (!o || !equal_at(v, *o, depth + 1)) return false;
      }
      return true;
    default:
      return a.ns == b.ns && a.fn == b.fn;
  }
}
}  // namespace

bool equal(const Value& a, const Value& b) { return equal_at(a, b, 0); }

}  // namespace r3::text::jinja
