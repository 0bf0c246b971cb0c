// The start-up report (issue 42): what an engine's construction cost, phase by phase, and the
// bytes it brought in, as `r3 serve` and `r3 generate` print it.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/safetensors.h"
#include "test_models.h"

namespace r3 {
namespace {

TEST(StartupReport, PhasesAndBytesAreMeasured) {
  const std::string dir = testing::test_model("olmoe", "tiny");
  Engine e(testing::small_config(dir));
  const StartupReport& s = e.startup();
  uint64_t stored = 0;
  SafetensorsFile f((std::filesystem::path(dir) / "model.safetensors").string());
  for (const auto& [name, t] : f.tensors()) stored += t.nbytes();
  EXPECT_EQ(s.checkpoint_bytes, stored);
  EXPECT_GT(s.open_seconds, 0);
  EXPECT_GT(s.build_seconds, 0);
  EXPECT_GT(s.read_seconds, 0);
  EXPECT_GT(s.pack_seconds, 0);
  EXPECT_LE(s.read_seconds + s.pack_seconds, s.open_seconds);
  EXPECT_GE(s.total_seconds, s.open_seconds + s.build_seconds);
  EXPECT_GT(s.kv_bytes, 0u);
  EXPECT_GT(s.resident_mb, 0);
  EXPECT_NE(s.line().find("weights 0.00 GB in "), std::string::npos) << s.line();
}

}  // namespace
}  // namespace r3
