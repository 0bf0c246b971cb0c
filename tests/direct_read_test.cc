// Reading past the page cache (issue 42): tensors the page cache does not hold are read with
// O_DIRECT by load_weights' reader thread, a layer ahead of the packing. The bytes must be the
// file's at any offset and length, from the inode that was opened even if the path is replaced,
// and a checkpoint loaded that way must serve exactly what a buffered load serves.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/file_read.h"
#include "core/thread_pool.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> b(n);
  for (uint8_t& x : b) x = uint8_t(rng());
  return b;
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Written pages leave the page cache once on disk, so the next read of them is a cold one.
void drop_from_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ::fdatasync(fd);
  (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
std::unique_ptr<uint8_t, AlignedFree> aligned_area(size_t n) {
  return std::unique_ptr<uint8_t, AlignedFree>(static_cast<uint8_t*>(
      std::aligned_alloc(RegularFile::kDirectAlign, (n + 4095) / 4096 * 4096)));
}

TEST(DirectRead, GivesTheFilesBytesAtAnyOffsetAndLength) {
  const std::string path =
      (fs::temp_directory_path() / ("r3_direct_" + std::to_string(getpid()))).string();
  const std::vector<uint8_t> bytes =
      random_bytes(5 * 4096 + 1234, 3);  // not a whole number of blocks
  write_file(path, bytes);
  RegularFile f(path, bytes.size(), "test file");
  std::mt19937_64 rng(11);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int i = 0; i < 200; ++i) {
    const uint64_t offset = rng() % bytes.size();
    const size_t n = i % 4 == 0 ? bytes.size() - offset
                                : size_t(rng() % (bytes.size() - offset)) + 1;  // to the end too
    auto area = aligned_area(RegularFile::direct_span(offset, n));
    const uint8_t* got = f.read_direct(offset, n, area.get(), deadline);
    if (!got) GTEST_SKIP() << "this file system refuses O_DIRECT";
    ASSERT_EQ(0, std::memcmp(got, bytes.data() + offset, n)) << "offset " << offset << " n " << n;
  }
  // The descriptor's file, not the path's: a file renamed over the path is not read.
  const std::string other = path + ".new";
  write_file(other, random_bytes(bytes.size(), 4));
  fs::rename(other, path);
  auto area = aligned_area(RegularFile::direct_span(100, 5000));
  const uint8_t* got = f.read_direct(100, 5000, area.get(), deadline);
  EXPECT_EQ(0, std::memcmp(got, bytes.data() + 100, 5000));
  // A file cut short since it was opened is an error naming it, not short data.
  fs::resize_file(path, 0);
  RegularFile g(path, 1 << 20, "test file");
  fs::resize_file(path, 4096);
  fs::resize_file(path, 100);
  try {
    (void)g.read_direct(0, 4096, area.get(), deadline);
    FAIL() << "a truncated file was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ended early"), std::string::npos) << e.what();
  }
  fs::remove(path);
}

TEST(DirectRead, CachedRangesAreToldApart) {
  const std::string path =
      (fs::temp_directory_path() / ("r3_cached_" + std::to_string(getpid()))).string();
  write_file(path, random_bytes(64 * 4096, 5));
  drop_from_page_cache(path);
  RegularFile f(path, 1 << 20, "test file");
  const std::optional<bool> before = f.mostly_cached(0, 64 * 4096);
  if (!before) {
    fs::remove(path);
    GTEST_SKIP() << "cachestat(2) missing (Linux 6.5)";
  }
  EXPECT_FALSE(*before);
  std::vector<uint8_t> buf(64 * 4096);
  f.read_at(0, buf.data(), buf.size(), std::chrono::steady_clock::now() + std::chrono::seconds(60));
  EXPECT_EQ(f.mostly_cached(0, 64 * 4096), std::optional<bool>(true));
  fs::remove(path);
}

// A whole tensor of several 64 MiB pieces, read on a pool's threads at once (a large
// embedding's read is mostly the first touch of its pages), is the file's bytes; a file cut
// short after it was opened is an r3::Error naming it on the calling thread (a throw left on a
// worker would end the process).
TEST(PooledRead, ALargeTensorIsTheFilesBytesAndAShortFileIsAnError) {
  const std::string path =
      (fs::temp_directory_path() / ("r3_pooled_" + std::to_string(getpid()) + ".safetensors"))
          .string();
  const int64_t n = (int64_t(130) << 20) + 777;  // three pieces, the last one short
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) bytes[size_t(i)] = uint8_t((i * 2654435761u) >> 13);
  write_safetensors(path, {{"big", DType::U8, {n}, bytes}});
  ThreadPool pool(2);
  {
    const SafetensorsFile f(path);
    std::vector<uint8_t> got(static_cast<size_t>(n));
    f.read_tensor("big", got.data(), &pool);
    EXPECT_TRUE(got == bytes);
  }
  const SafetensorsFile f(path);
  fs::resize_file(path, fs::file_size(path) - (uint64_t(80) << 20));  // the last two pieces gone
  std::vector<uint8_t> got(static_cast<size_t>(n));
  try {
    f.read_tensor("big", got.data(), &pool);
    ADD_FAILURE() << "a file cut short was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  fs::remove(path);
}

// Whatever the checkpoint's size, the loader reads a tensor the page cache does not hold past
// it (a buffered read first-touches as many page-cache bytes as the weights' own: a cold start of
// the 7.1 GB FP8 preset took twice as long) and copies one it holds from it; both serve the same.
TEST(DirectRead, UncachedLayersArePastThePageCacheAndCachedOnesFromIt) {
  const std::string dir =
      testing::copy_test_model(testing::test_model("olmoe", "small", 5), "DirectReadCold", "olmoe");
  std::vector<std::string> files;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") files.push_back(f.path().string());
  const uint64_t size = fs::file_size(files[0]);
  if (!RegularFile(files[0], size, "test file").mostly_cached(0, size))
    GTEST_SKIP()
        << "cachestat(2) missing (Linux 6.5): cold and cached tensors cannot be told apart";
  for (const std::string& f : files) drop_from_page_cache(f);
  if (RegularFile(files[0], size, "test file").mostly_cached(0, size).value_or(true))
    GTEST_SKIP() << "the files stay in the page cache (tmpfs?): no cold read to make";
  Engine cold(testing::small_config(dir));
  if (cold.checkpoint().load_figures().direct_bytes == 0) {
    const int fd = ::open(files[0].c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) GTEST_SKIP() << "the file system refuses O_DIRECT";
    ::close(fd);
  }
  EXPECT_GT(cold.checkpoint().load_figures().direct_bytes, 0u);
  for (const std::string& f : files) {  // read once through the page cache, as `cat` does
    const RegularFile file(f, fs::file_size(f), "test file");
    std::vector<uint8_t> bytes(size_t(fs::file_size(f)));
    file.read_at(0, bytes.data(), bytes.size(),
                 std::chrono::steady_clock::now() + std::chrono::seconds(60));
  }
  Engine cached(testing::small_config(dir));
  EXPECT_EQ(cached.checkpoint().load_figures().direct_bytes, 0u);
  const RequestOutput a = cold.generate({{3, 4, 5, 6, 7}}, {testing::greedy(6)})[0];
  const RequestOutput b = cached.generate({{3, 4, 5, 6, 7}}, {testing::greedy(6)})[0];
  EXPECT_EQ(a.token_ids, b.token_ids);
  EXPECT_EQ(a.logprobs, b.logprobs);
  fs::remove_all(dir);
}

// Seeded choice of families and storage (bf16 per-expert, fused MXFP4, block FP8): each loads
// past the page cache to the same tokens, logprobs and routes as a buffered load.
TEST(DirectRead, ALargeCheckpointLoadedPastThePageCacheServesTheSame) {
  for (const char* arch : {"olmoe", "gpt_oss_mxfp4", "qwen3_moe_fp8"}) {
    SCOPED_TRACE(arch);
    const std::string dir =
        testing::copy_test_model(testing::test_model(arch, "tiny", 5), "DirectRead", arch);
    Engine buffered(testing::small_config(dir));
    const RequestOutput want = buffered.generate({{3, 4, 5, 6, 7}}, {testing::greedy(6)})[0];
    for (const auto& f : fs::directory_iterator(dir))
      if (f.path().extension() == ".safetensors") drop_from_page_cache(f.path().string());
    Checkpoint::treat_files_as_large(true);
    struct Back {
      ~Back() { Checkpoint::treat_files_as_large(false); }
    } back;
    Engine direct(testing::small_config(dir));
    const Checkpoint::LoadFigures& figures = direct.checkpoint().load_figures();
    if (figures.direct_bytes == 0)
      GTEST_SKIP() << "no direct reads here (O_DIRECT refused, or the files stayed cached)";
    // The decoder layers' tensors (the reader's), but for any that start off an 8-byte boundary.
    uint64_t layer_bytes = 0;
    for (const auto& f : fs::directory_iterator(dir))
      if (f.path().extension() == ".safetensors") {
        const SafetensorsFile file(f.path().string());
        for (const auto& [name, view] : file.tensors())
          if (name.rfind("model.layers.", 0) == 0) layer_bytes += view.nbytes();
      }
    EXPECT_LE(figures.direct_bytes, layer_bytes);
    EXPECT_GT(figures.direct_bytes, layer_bytes / 2);
    const RequestOutput got = direct.generate({{3, 4, 5, 6, 7}}, {testing::greedy(6)})[0];
    EXPECT_EQ(got.token_ids, want.token_ids);
    EXPECT_EQ(got.logprobs, want.logprobs);
    ASSERT_TRUE(got.routed_experts && want.routed_experts);
    EXPECT_EQ(got.routed_experts->data, want.routed_experts->data);
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace r3
