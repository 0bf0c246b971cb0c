#include "args.h"

#include <cstdio>

#include "core/error.h"

namespace r3::cli {

Args& Args::opt(const std::string& name, const std::string& dflt, const std::string& help) {
  specs_.push_back({name, help, dflt, false});
  values_[name] = dflt;
  return *this;
}

Args& Args::flag(const std::string& name, bool dflt, const std::string& help) {
  specs_.push_back({name, help, dflt ? "1" : "0", true});
  values_[name] = dflt ? "1" : "0";
  return *this;
}

const Args::Spec& Args::spec(const std::string& name) const {
  for (auto& s : specs_)
    if (s.name == name) return s;
  throw Error("r3 " + verb_ + ": unknown option --" + name + " (see r3 " + verb_ + " --help)");
}

bool Args::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a.rfind("--", 0) != 0) throw Error("r3 " + verb_ + ": unexpected argument \"" + a + "\"");
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    bool negated = false;
    if (name.rfind("no-", 0) == 0 && !values_.count(name)) {
      negated = true;
      name = name.substr(3);
    }
    const Spec& s = spec(name);
    if (s.is_bool) {
      if (has_value) throw Error("r3 " + verb_ + ": --" + name + " takes no value");
      values_[name] = negated ? "0" : "1";
    } else {
      if (negated) throw Error("r3 " + verb_ + ": unknown option --no-" + name);
      if (!has_value) {
        if (i + 1 >= argc) throw Error("r3 " + verb_ + ": --" + name + " needs a value");
        value = argv[++i];
      }
      values_[name] = value;
    }
    given_.insert(name);
  }
  return true;
}

std::string Args::str(const std::string& name) const {
  spec(name);
  return values_.at(name);
}

int64_t Args::integer(const std::string& name) const {
  std::string v = str(name);
  try {
    size_t used = 0;
    int64_t x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (...) {
  }
  throw Error("r3 " + verb_ + ": --" + name + " expects an integer, got \"" + v + "\"");
}

double Args::number(const std::string& name) const {
  std::string v = str(name);
  try {
    size_t used = 0;
    double x = std::stod(v, &used);
    if (used == v.size()) return x;
  } catch (...) {
  }
  throw Error("r3 " + verb_ + ": --" + name + " expects a number, got \"" + v + "\"");
}

bool Args::on(const std::string& name) const { return str(name) == "1"; }

std::string Args::help() const {
  std::string h = "usage: r3 " + verb_ + " [options]\n\n" + summary_ + "\n\noptions:\n";
  for (auto& s : specs_) {
    std::string left = "  --" + s.name + (s.is_bool ? "" : " VALUE");
    if (s.is_bool) left = "  --" + s.name + " / --no-" + s.name;
    h += left + std::string(left.size() < 36 ? 36 - left.size() : 1, ' ') + s.help;
    if (!s.is_bool && !s.dflt.empty()) h += " (default: " + s.dflt + ")";
    if (s.is_bool) h += s.dflt == "1" ? " (default: on)" : " (default: off)";
    h += "\n";
  }
  return h;
}

}  // namespace r3::cli
