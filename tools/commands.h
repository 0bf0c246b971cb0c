// The r3 verbs; each returns the process exit code.
#pragma once

namespace r3::cli {

int cmd_make_model(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_align(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);

}  // namespace r3::cli
