// The families r3 serves, one row each: the Arch, r3's name for it (make-model --arch, /metrics,
// model_type in /get_model_info) and the Hugging Face model classes a config.json's
// "architectures" may name for it. parse_config, arch_short_name, make-model's help, the tests'
// family list and r3.torch (through _r3._families) all read this table: a new family is its row
// here, its parse branch in config.cc and only the blocks it adds (docs/ARCHITECTURE.md,
// "Adding a family").
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace r3 {

struct Family {
  Arch arch;
  const char* name;
  std::vector<const char*> hf_classes;  // the first is what make-model writes
};

const std::vector<Family>& families();
// The row of an HF class, or null.
const Family* family_of_hf_class(const std::string& hf_class);
// Every HF class r3 reads, comma separated (for errors).
std::string supported_hf_classes();

}  // namespace r3
