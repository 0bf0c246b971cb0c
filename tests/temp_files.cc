// Test processes write their files under temp folders named r3_<what>_<pid> (test models written
// once per process, copies a test may damage, CLI runs' inputs): they go when the process ends. A
// run leaves about 250 MB otherwise, which piled up to 15 GB in /tmp over a day's runs here.
// R3_KEEP_TEST_FILES=1 keeps them, to look at after a failure.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace r3::testing {
namespace {

class RemoveTempFiles : public ::testing::Environment {
 public:
  void TearDown() override {
    if (const char* keep = std::getenv("R3_KEEP_TEST_FILES"); keep && *keep && *keep != '0') return;
    namespace fs = std::filesystem;
    const std::string suffix = "_" + std::to_string(::getpid());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(fs::temp_directory_path(), ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("r3_", 0) == 0 && name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        fs::remove_all(entry.path(), ec);  // best effort: a test's own file may be held open
    }
  }
};

[[maybe_unused]] ::testing::Environment* const kRemoveTempFiles =
    ::testing::AddGlobalTestEnvironment(new RemoveTempFiles);

}  // namespace
}  // namespace r3::testing
