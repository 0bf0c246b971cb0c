// Every weight held once (model/checkpoint.h): the packed panels are the only copy of the
// matrices, so resident memory is the checkpoint's bytes once (peak included: a layer is staged,
// packed and dropped at a time), refits repack in place, files rewritten after the load change
// nothing served, and a reload after release_memory_occupation refuses files that changed.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using testing::greedy;
using testing::test_model;

// This process's peak resident bytes (VmHWM), and the current (VmRSS).
uint64_t status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::string(key).size()));
  return 0;
}

// Runs fn in a child process (a fresh peak) and returns what it wrote to the pipe.
template <typename Fn>
std::string in_child(Fn fn) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      out = fn();
    } catch (const std::exception& e) {
      out = std::string("error: ") + e.what();
    }
    (void)!write(fds[1], out.data(), out.size());
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string got;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, size_t(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return got;
}

// Every stored tensor of a checkpoint directory, as a trainer would send them.
std::vector<TensorToWrite> all_tensors(const std::string& dir) {
  std::vector<TensorToWrite> all;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".safetensors")
      for (TensorToWrite& t : read_safetensors(f.path().string())) all.push_back(std::move(t));
  return all;
}

// A copy of the tensors of one unit of `all` (0: those outside the decoder layers; 1 + l: layer
// l), made when it is sent, as a trainer's bucket is.
std::vector<TensorToWrite> unit_bucket(const std::vector<TensorToWrite>& all, int unit) {
  std::vector<TensorToWrite> bucket;
  for (const TensorToWrite& t : all)
    if (unit == 0 ? t.name.rfind("model.layers.", 0) != 0
                  : t.name.rfind(layer_prefix(unit - 1), 0) == 0)
      bucket.push_back(t);
  return bucket;
}

uint64_t bytes_of(const std::vector<TensorToWrite>& tensors) {
  uint64_t bytes = 0;
  for (const TensorToWrite& t : tensors) bytes += t.bytes.size();
  return bytes;
}

// Peak resident memory across an open and a refit in one-layer buckets: the resident weights
// are the checkpoint's bytes once, and the peak is those plus one layer being staged (a second
// copy of the matrices would add all of them). Big buffers are 2 MiB transparent huge pages, so
// each unit's panels and the staging area may round up by one such page. Measured in a child so
// its peak is its own.
TEST(SingleCopy, PeakResidentMemoryIsTheWeightsOnce) {
  const std::string model = test_model("olmoe", "small"), other = test_model("olmoe", "small", 7);
  const std::string got = in_child([&] {
    const uint64_t base = status_kb("VmRSS:") * 1024;
    std::shared_ptr<Checkpoint> ck = Checkpoint::open(model);
    const uint64_t stored = ck->stored_bytes(), loaded_peak = status_kb("VmHWM:") * 1024;
    const uint64_t loaded_now = status_kb("VmRSS:") * 1024;
    const uint64_t held = ck->packed_bytes() + ck->kept_bytes();
    // A refit from disk: in place, a layer at a time.
    std::shared_ptr<Checkpoint> next = Checkpoint::headers(other);
    ck->check_refit(*next);
    ck->refit_from(*next);
    const uint64_t disk_refit_peak = status_kb("VmHWM:") * 1024;
    // A refit from tensors, a layer per bucket.
    const std::vector<TensorToWrite> all = all_tensors(model);
    uint64_t largest_bucket = 0;
    for (int unit = 0; unit <= ck->config().num_layers; ++unit) {
      std::vector<TensorToWrite> bucket = unit_bucket(all, unit);
      largest_bucket = std::max(largest_bucket, bytes_of(bucket));
      ck->apply_update(std::move(bucket));
    }
    const uint64_t all_bytes = bytes_of(all);
    const uint64_t refit_peak = status_kb("VmHWM:") * 1024;
    return std::to_string(stored) + " " + std::to_string(held) + " " +
           std::to_string(loaded_peak - base) + " " + std::to_string(loaded_now - base) + " " +
           std::to_string(refit_peak - base) + " " + std::to_string(all_bytes) + " " +
           std::to_string(largest_bucket) + " " + std::to_string(ck->config().num_layers) + " " +
           std::to_string(disk_refit_peak - base);
  });
  ASSERT_EQ(got.find("error"), std::string::npos) << got;
  std::istringstream in(got);
  double stored = 0, held = 0, load_peak = 0, loaded = 0, refit_peak = 0, all_bytes = 0, layer = 0,
         layers = 0, disk_peak = 0;
  in >> stored >> held >> load_peak >> loaded >> refit_peak >> all_bytes >> layer >> layers >>
      disk_peak;
  std::printf(
      "[ single copy ] stored %.1f MB, held %.1f MB, resident after load +%.1f MB, load peak +%.1f "
      "MB, "
      "largest layer %.1f MB, disk refit peak +%.1f MB, tensor refit peak +%.1f MB\n",
      stored / 1e6, held / 1e6, loaded / 1e6, load_peak / 1e6, layer / 1e6, disk_peak / 1e6,
      refit_peak / 1e6);
  EXPECT_LE(held, 1.02 * stored);
  const double huge_pages = (layers + 2) * 2.0 * (1 << 20), slack = 4e6;  // threads, allocator
  EXPECT_LE(loaded, held + huge_pages + slack);
  EXPECT_LE(load_peak, held + layer + huge_pages + slack);
  EXPECT_LE(disk_peak, held + layer + huge_pages + slack);
  // The test's own copy of every tensor (the trainer's) and of one bucket is resident too.
  EXPECT_LE(refit_peak, held + all_bytes + 2 * layer + huge_pages + slack);
}

// A model whose embedding and lm_head are its largest tensors (as in gpt-oss-20b: 1.2 GB each):
// a refit from disk holds one of them at a time beyond the weights: the bytes read, and for the
// packed lm_head its new panels until the old ones go (twice the largest tensor). It held both,
// plus a copy of the embedding, before unit 0 went a tensor at a time and the kept embedding
// took the read bytes themselves (+50.4 MB here then, +36.9 MB now, for 16.8 MB tensors).
TEST(SingleCopy, ARefitFromDiskHoldsAtMostTheLargestTensorBeyondTheWeights) {
  const std::string dir =
      (fs::temp_directory_path() / ("r3_single_copy_vocab_" + std::to_string(getpid()))).string();
  make_model({.arch = "olmoe",
              .preset = "tiny",
              .seed = 3,
              .out = dir,
              .config_patch = R"({"vocab_size": 131072, "tie_word_embeddings": false})"});
  const std::string got = in_child([&] {
    std::shared_ptr<Checkpoint> ck = Checkpoint::open(dir);
    const uint64_t resident = status_kb("VmRSS:") * 1024;
    std::shared_ptr<Checkpoint> next = Checkpoint::headers(dir);
    ck->check_refit(*next);
    ck->refit_from(*next);
    const uint64_t peak = status_kb("VmHWM:") * 1024;
    uint64_t largest = 0, layer = 0;
    const std::vector<TensorToWrite> all = all_tensors(dir);
    for (const TensorToWrite& t : all) largest = std::max<uint64_t>(largest, t.bytes.size());
    for (int unit = 1; unit <= ck->config().num_layers; ++unit)
      layer = std::max(layer, bytes_of(unit_bucket(all, unit)));
    return std::to_string(peak > resident ? peak - resident : 0) + " " + std::to_string(largest) +
           " " + std::to_string(layer);
  });
  fs::remove_all(dir);
  ASSERT_EQ(got.find("error"), std::string::npos) << got;
  std::istringstream in(got);
  double above = 0, largest = 0, layer = 0;
  in >> above >> largest >> layer;
  std::printf(
      "[ single copy ] refit from disk: peak +%.1f MB over the loaded weights; largest tensor %.1f "
      "MB, largest layer %.1f MB\n",
      above / 1e6, largest / 1e6, layer / 1e6);
  EXPECT_GT(largest, 4 * layer);  // the embedding dominates, as intended
  // The test's own read of every tensor (all_tensors) came after the peak was taken.
  EXPECT_LE(above, 2 * largest + layer + 4 * 2.0 * (1 << 20) + 4e6);
}

// The engine's refit from tensors in one-layer buckets: each bucket is packed in place as it
// arrives, so the peak is the resident engine, the trainer's copy of the tensors (the test's)
// and about two buckets (one applied, the one before being freed). Keeping the buckets until
// the last one, as a staged refit would, adds every tensor again.
TEST(SingleCopy, ARefitInBucketsHoldsAboutOneBucket) {
  const std::string model = test_model("olmoe", "small"), other = test_model("olmoe", "small", 7);
  const std::string got = in_child([&] {
    EngineConfig c = testing::small_config(model);
    Engine e(c);
    e.generate({{3, 4, 5, 6}}, {greedy(2)});
    const std::vector<TensorToWrite> all = all_tensors(other);
    std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM starts again from VmRSS
    const uint64_t resident = status_kb("VmRSS:") * 1024;
    uint64_t largest_bucket = 0;
    const int layers = e.model_config().num_layers;
    for (int unit = 0; unit <= layers; ++unit) {
      std::vector<TensorToWrite> bucket = unit_bucket(all, unit);
      largest_bucket = std::max(largest_bucket, bytes_of(bucket));
      e.stage_weights(std::move(bucket));
    }
    e.commit_staged_weights(true);
    const uint64_t all_bytes = bytes_of(all);
    const uint64_t peak = status_kb("VmHWM:") * 1024;
    return std::to_string(peak - resident) + " " + std::to_string(largest_bucket) + " " +
           std::to_string(all_bytes) + " " + std::to_string(layers);
  });
  ASSERT_EQ(got.find("error"), std::string::npos) << got;
  std::istringstream in(got);
  double grew = 0, bucket = 0, all_bytes = 0, layers = 0;
  in >> grew >> bucket >> all_bytes >> layers;
  std::printf(
      "[ single copy ] refit in %d buckets of at most %.1f MB (%.1f MB in all): peak +%.1f MB over "
      "the engine\n",
      int(layers) + 1, bucket / 1e6, all_bytes / 1e6, grew / 1e6);
  EXPECT_LE(grew, 2 * bucket + 4e6) << "the buckets were kept rather than packed as they came";
}

// A kept tensor read into a staging chunk of its own (a large vocabulary's embedding: gpt-oss-20b's
// is 1.16 GB) stays in that chunk instead of being copied out; small staging chunks make a small
// model's embedding (and its larger small tensors) such tensors. It serves what a load with the
// copies serves, and so after a refit from disk and one from tensors (where the adopted chunks
// are handed back as replaced storage).
TEST(SingleCopy, AnEmbeddingReadAloneStaysWhereItWasRead) {
  const std::string model = test_model("olmoe", "small"), other = test_model("olmoe", "small", 7);
  auto run = [](Engine& e) { return e.generate({{3, 4, 5, 6, 7}}, {greedy(5)})[0]; };
  auto same = [](const RequestOutput& got, const RequestOutput& want) {
    EXPECT_EQ(got.token_ids, want.token_ids);
    EXPECT_EQ(got.logprobs, want.logprobs);
  };
  Engine copied(testing::small_config(model));
  const uint64_t kept = copied.checkpoint().kept_bytes();
  EXPECT_EQ(copied.checkpoint().load_figures().adopted_bytes, 0u);
  const RequestOutput want = run(copied);
  copied.update_weights(other, true);
  const RequestOutput want_other = run(copied);
  Checkpoint::set_staging_chunk_bytes(4096);
  struct Back {
    ~Back() { Checkpoint::set_staging_chunk_bytes(0); }
  } back;
  Engine adopted(testing::small_config(model));
  const Checkpoint::LoadFigures figures = adopted.checkpoint().load_figures();
  const uint64_t embedding = uint64_t(adopted.model_config().vocab_size) *
                             uint64_t(adopted.model_config().hidden_size) * 2;
  EXPECT_GE(figures.adopted_bytes, embedding);
  EXPECT_EQ(adopted.checkpoint().kept_bytes(), kept);
  same(run(adopted), want);
  adopted.update_weights(other, true);  // from disk
  same(run(adopted), want_other);
  const std::vector<TensorToWrite> all = all_tensors(model);
  for (int unit = 0; unit <= adopted.model_config().num_layers; ++unit)
    adopted.stage_weights(unit_bucket(all, unit));
  adopted.commit_staged_weights(true);  // from tensors, back to the first weights
  same(run(adopted), want);
}

std::string copy_model(const std::string& src, const std::string& name) {
  return testing::copy_test_model(src, "r3_single_copy", name);
}

// Files rewritten after the load change nothing served (nothing is read from them again); a
// resume after release_memory_occupation refuses them by name, and a refit from disk serves them.
TEST(SingleCopy, FilesRewrittenAfterTheLoadChangeNothingServed) {
  const std::string dir = copy_model(test_model("olmoe", "tiny", 0), "rewritten");
  Engine e(testing::small_config(dir));
  const RequestOutput before = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  // Rewrite the file in place with another seed's weights, then truncate it.
  const std::vector<TensorToWrite> other =
      read_safetensors(test_model("olmoe", "tiny", 7) + "/model.safetensors");
  write_safetensors(dir + "/model.safetensors", other);
  const RequestOutput rewritten = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  EXPECT_EQ(rewritten.token_ids, before.token_ids);
  EXPECT_EQ(rewritten.logprobs, before.logprobs);
  fs::resize_file(dir + "/model.safetensors", 100);
  EXPECT_EQ(e.generate({{3, 4, 5, 6}}, {greedy(6)})[0].logprobs, before.logprobs);
  e.release_memory(true, true);
  try {
    e.resume_memory(true, true);
    FAIL() << "a resume read a changed file";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model.safetensors: changed since it was read"),
              std::string::npos)
        << err.what();
  }
  EXPECT_THROW(e.generate({{3, 4, 5, 6}}, {greedy(6)}), Error);  // still released, and says so
  write_safetensors(dir + "/model.safetensors", other);
  e.update_weights(dir, true);  // a refit from disk serves the new files
  Engine want(testing::small_config(test_model("olmoe", "tiny", 7)));
  EXPECT_EQ(e.generate({{3, 4, 5, 6}}, {greedy(6)})[0].logprobs,
            want.generate({{3, 4, 5, 6}}, {greedy(6)})[0].logprobs);
  fs::remove_all(fs::path(dir).parent_path());
}

// A refit from disk checks everything that needs no weight value before anything changes (a
// tensor of another shape, a bad block scale: refused, the old weights serve); a failure after
// that (a file truncated while the refit reads it) leaves some layers new and the others old, and
// the checkpoint says so: it is no set of files (reload refuses), and the engine refuses requests
// (WeightSync.NonFiniteWeightsAreRefused).
TEST(SingleCopy, ARefitFailingMidwayIsNeverTakenForAGoodOne) {
  const std::string a = test_model("olmoe", "small", 0);
  std::shared_ptr<Checkpoint> ck = Checkpoint::open(a);
  const std::string dir = copy_model(test_model("olmoe", "small", 7), "midway");
  // Refused before anything changes: a tensor of another shape.
  {
    const std::string other = copy_model(test_model("olmoe", "small", 7), "reshaped");
    std::vector<TensorToWrite> ts;
    for (const auto& f : fs::directory_iterator(other))
      if (f.path().extension() == ".safetensors") {
        ts = read_safetensors(f.path().string());
        for (TensorToWrite& t : ts)
          if (t.name == "model.norm.weight") {
            t.shape = {t.shape[0] / 2};
            t.bytes.resize(t.bytes.size() / 2);
          }
        write_safetensors(f.path().string(), ts);
      }
    std::shared_ptr<Checkpoint> next;
    try {
      next = Checkpoint::headers(other);
      ck->check_refit(*next);
      ADD_FAILURE() << "a reshaped tensor was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(ck->updated_in_memory());
    fs::remove_all(other);
  }
  // Two shards: the embedding, lm_head and layers 0-1 first (a refit reads them first), layers
  // 2-3 in the second, which is truncated after the headers were checked.
  std::vector<TensorToWrite> first, second;
  std::string index = "{\"weight_map\": {";
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") {
      for (TensorToWrite& t : read_safetensors(f.path().string())) {
        const bool late =
            t.name.rfind("model.layers.2.", 0) == 0 || t.name.rfind("model.layers.3.", 0) == 0;
        index += std::string(first.size() + second.size() ? ", " : "") + "\"" + t.name + "\": \"" +
                 (late ? "b.safetensors" : "a.safetensors") + "\"";
        (late ? second : first).push_back(std::move(t));
      }
      fs::remove(f.path());
    }
  write_safetensors(dir + "/a.safetensors", first);
  write_safetensors(dir + "/b.safetensors", second);
  std::ofstream(dir + "/model.safetensors.index.json") << index << "}}";
  std::shared_ptr<Checkpoint> next = Checkpoint::headers(dir);
  ck->check_refit(*next);
  fs::resize_file(dir + "/b.safetensors", fs::file_size(dir + "/b.safetensors") / 2);
  EXPECT_THROW(ck->refit_from(*next), Error);
  EXPECT_TRUE(ck->updated_in_memory()) << "a half-refitted checkpoint passed for its files";
  EXPECT_THROW(ck->reload(), Error);
  fs::remove_all(fs::path(dir).parent_path());
}

// Weights a refit sent from memory are on no disk: after a release they come back with the next
// refit (SGLang's resume-then-update order), and generating before that is refused.
TEST(SingleCopy, WeightsSentFromMemoryComeBackWithTheNextRefit) {
  const std::string a = test_model("olmoe", "tiny", 0), b = test_model("olmoe", "tiny", 7);
  Engine e(testing::small_config(a));
  e.stage_weights(read_safetensors(b + "/model.safetensors"));
  e.commit_staged_weights(true);
  const RequestOutput sent = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  e.release_memory(true, true);
  e.resume_memory(true, true);
  EXPECT_THROW(e.generate({{3, 4, 5, 6}}, {greedy(6)}), Error);
  std::vector<TensorToWrite> part = read_safetensors(b + "/model.safetensors");
  part.pop_back();
  e.stage_weights(part);
  EXPECT_THROW(e.commit_staged_weights(true), Error) << "a released checkpoint needs every tensor";
  e.stage_weights(read_safetensors(b + "/model.safetensors"));
  e.commit_staged_weights(true);
  EXPECT_EQ(e.generate({{3, 4, 5, 6}}, {greedy(6)})[0].logprobs, sent.logprobs);
}

}  // namespace
}  // namespace r3
