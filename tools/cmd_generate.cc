#include "args.h"
#include "commands.h"

namespace r3::cli {

int cmd_generate(int argc, char** argv) { return 2; }

}  // namespace r3::cli
