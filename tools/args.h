// A small command-line parser for the r3 verbs: --flag value, --flag=value, --bool-flag,
// --no-bool-flag; unknown flags and missing values are errors that name the flag.
#pragma once
#include <map>
#include <set>
#include <string>
#include <vector>

namespace r3::cli {

class Args {
 public:
  struct Spec {
    std::string name, help, dflt;
    bool is_bool = false;
  };
  Args(std::string verb, std::string summary)
      : verb_(std::move(verb)), summary_(std::move(summary)) {}
  Args& opt(const std::string& name, const std::string& dflt, const std::string& help);
  Args& flag(const std::string& name, bool dflt, const std::string& help);
  // Returns false when --help was asked (help is printed).
  bool parse(int argc, char** argv);

  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double number(const std::string& name) const;
  bool on(const std::string& name) const;
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  std::string help() const;

 private:
  const Spec& spec(const std::string& name) const;
  std::string verb_, summary_;
  std::vector<Spec> specs_;
  std::map<std::string, std::string> values_;
  std::set<std::string> given_;
};

}  // namespace r3::cli
