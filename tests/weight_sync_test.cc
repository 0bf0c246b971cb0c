// In-memory weight sync: a trainer's tensors by Hugging Face name, sent in buckets, applied at
// once between steps; the engine then equals a fresh engine on those weights. Every bucket is
// checked first (name, shape, dtype) and a refused one changes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/safetensors.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using testing::greedy;
using testing::test_model;

std::vector<TensorToWrite> tensors_of(const std::string& dir) {
  return read_safetensors((fs::path(dir) / "model.safetensors").string());
}

EngineConfig config_for(const std::string& model) { return testing::small_config(model); }

TEST(WeightSync, BucketsApplyInPlaceAndEqualAFreshEngine) {
  const std::string a = test_model("olmoe", "tiny", 0), b = test_model("olmoe", "tiny", 7);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    EngineConfig c = config_for(a);
    c.overlap_scheduler = overlap;
    Engine e(c);
    // A request running when the first bucket lands ends (reason abort) with what it generated.
    const uint64_t running = e.add_request({3, 4, 5, 6, 7}, greedy(50));
    for (int i = 0; i < 3; ++i) e.step();
    std::vector<TensorToWrite> all = tensors_of(b);
    const size_t third = all.size() / 3;
    std::vector<TensorToWrite> b1(all.begin(), all.begin() + ptrdiff_t(third)),
        b2(all.begin() + ptrdiff_t(third), all.begin() + ptrdiff_t(2 * third)),
        b3(all.begin() + ptrdiff_t(2 * third), all.end());
    e.stage_weights(b1);
    std::vector<RequestOutput> ended;
    for (RequestOutput& o : e.apply_aborts())
      if (o.finished) ended.push_back(std::move(o));
    ASSERT_EQ(ended.size(), 1u);
    EXPECT_EQ(ended[0].request_id, running);
    EXPECT_EQ(ended[0].finish_reason, "abort");
    EXPECT_GT(ended[0].token_ids.size(), 0u);
    EXPECT_FALSE(e.has_unfinished());
    e.stage_weights(b2);
    // Applied in place: the weights are part old, part new, so nothing may run on them.
    try {
      e.generate({{3, 4, 5, 6}}, {greedy(6)});
      ADD_FAILURE() << "a request ran on a half-applied refit";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("refit in buckets is under way"), std::string::npos)
          << err.what();
    }
    EXPECT_EQ(e.weight_version(), 0u);
    e.stage_weights(b3);
    EXPECT_EQ(e.staged_weight_tensors(), all.size());
    e.commit_staged_weights(true);
    EXPECT_EQ(e.weight_version(), 1u);
    EXPECT_EQ(e.staged_weight_tensors(), 0u);
    Engine fresh(config_for(b));
    const RequestOutput want = fresh.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
    const RequestOutput got = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
    EXPECT_EQ(got.token_ids, want.token_ids);
    EXPECT_EQ(got.logprobs, want.logprobs);
    EXPECT_EQ(got.routed_experts->data, want.routed_experts->data);
  }
}

// A refit of a few tensors repacks only their panels, in place: the engine then equals a fresh
// engine on a checkpoint holding the new tensors and the old rest, over two refits in a row. On
// DeepSeek-V3 the refit of layer 1 includes kv_b, whose absorbed per-head copies must follow; on
// GPT-OSS its fused experts (float, or MXFP4 blocks and scales), whose per-expert split must. On
// FP8 DeepSeek-V3 a third refit sends layer 0's block scales alone: the panels of every weight
// whose scales changed must be rebuilt though its values did not change.
TEST(WeightSync, APartialRefitEqualsAFreshEngineOnTheMixedWeights) {
  for (const char* arch : {"olmoe", "deepseek_v3", "gpt_oss", "gpt_oss_mxfp4", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(arch);
    const std::string a = test_model(arch, "tiny", 0), b = test_model(arch, "tiny", 7);
    const std::vector<TensorToWrite> new_all = tensors_of(b);
    std::vector<TensorToWrite> mixed = tensors_of(a);  // what the engine holds after each refit
    Engine e(config_for(a));
    const RequestOutput before = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
    const fs::path dir = fs::temp_directory_path() / ("r3_mixed_" + std::to_string(getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(fs::path(a) / "config.json", dir / "config.json");
    std::vector<std::string> prefixes = {"model.layers.1.", "lm_head"};
    const bool fp8 = std::string(arch).find("fp8") != std::string::npos;
    if (fp8) prefixes.push_back("model.layers.0.*_scale_inv");
    for (const std::string& prefix : prefixes) {
      std::vector<TensorToWrite> bucket;
      const size_t star = prefix.find('*');
      auto selected = [&](const std::string& name) {
        if (star == std::string::npos) return name.rfind(prefix, 0) == 0;
        const std::string head = prefix.substr(0, star), tail = prefix.substr(star + 1);
        return name.rfind(head, 0) == 0 && name.size() >= tail.size() &&
               name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
      };
      // MLA's kv_b is decoded to bf16 at load (its FP8 codes are not kept): new scales for it
      // come with its codes.
      auto codes_needed = [&](const std::string& name) {
        return star != std::string::npos && name == "model.layers.0.self_attn.kv_b_proj.weight";
      };
      for (const TensorToWrite& t : new_all)
        if (selected(t.name) || codes_needed(t.name)) {
          bucket.push_back(t);
          for (TensorToWrite& m : mixed)
            if (m.name == t.name) m = t;
        }
      ASSERT_FALSE(bucket.empty()) << prefix;
      e.stage_weights(bucket);
      e.commit_staged_weights(true);
      write_safetensors((dir / "model.safetensors").string(), mixed);
      Engine fresh(config_for(dir.string()));
      const RequestOutput want = fresh.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
      const RequestOutput got = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
      EXPECT_EQ(got.token_ids, want.token_ids) << prefix;
      EXPECT_EQ(got.logprobs, want.logprobs) << prefix;
      EXPECT_EQ(got.routed_experts->data, want.routed_experts->data) << prefix;
      EXPECT_NE(got.logprobs, before.logprobs) << prefix << ": the refit changed nothing";
    }
    fs::remove_all(dir);
  }
}

TEST(WeightSync, ARefusedBucketChangesNothing) {
  const std::string a = test_model("olmoe", "tiny", 0), b = test_model("olmoe", "tiny", 7);
  Engine e(config_for(a));
  const RequestOutput before = e.generate({{3, 4, 5}}, {greedy(5)})[0];
  std::vector<TensorToWrite> good = tensors_of(b);
  auto expect_refused = [&](std::vector<TensorToWrite> bucket, const std::string& needle) {
    const size_t staged = e.staged_weight_tensors();
    try {
      e.stage_weights(std::move(bucket));
      ADD_FAILURE() << "accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
    EXPECT_EQ(e.staged_weight_tensors(), staged);
  };
  std::vector<TensorToWrite> bucket = {good[0], good[1]};
  bucket[1].name = "model.layers.0.self_attn.q_proj.bias";
  expect_refused(bucket, "not in the served model");
  bucket = {good[0]};
  bucket[0].shape.push_back(1);
  expect_refused(bucket, "the served model's is");
  bucket = {good[0]};
  bucket[0].dtype = bucket[0].dtype == DType::F32 ? DType::BF16 : DType::F32;
  expect_refused(bucket, "the served model's is");
  bucket = {good[0]};
  bucket[0].bytes.pop_back();
  expect_refused(bucket, "bytes");
  EXPECT_THROW(e.commit_staged_weights(true), Error);  // nothing staged
  // A tied model: an update that would make a stored lm_head differ from the embedding is
  // refused at commit, before any byte is written.
  {
    // qwen3_moe tiny ties its embeddings; store lm_head too, equal to the embedding.
    const std::string src = test_model("qwen3_moe", "tiny");
    const std::string tied =
        (fs::temp_directory_path() / ("r3_tied_" + std::to_string(getpid()))).string();
    fs::remove_all(tied);
    fs::create_directories(tied);
    fs::copy_file(fs::path(src) / "config.json", fs::path(tied) / "config.json");
    std::vector<TensorToWrite> mine = tensors_of(src);
    TensorToWrite embed;
    for (auto& w : mine)
      if (w.name == "model.embed_tokens.weight") embed = w;
    TensorToWrite head = embed;
    head.name = "lm_head.weight";
    mine.push_back(head);
    write_safetensors(tied + "/model.safetensors", mine);
    Engine t(config_for(tied));
    const RequestOutput t_before = t.generate({{3, 4, 5}}, {greedy(4)})[0];
    const size_t row = embed.bytes.size() / size_t(embed.shape[0]);
    embed.bytes[3 * row] ^= 0x40;  // token 3's embedding, which the prompt reads
    t.stage_weights({embed});
    try {
      t.commit_staged_weights(true);
      ADD_FAILURE() << "accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("tie_word_embeddings"), std::string::npos)
          << err.what();
    }
    EXPECT_EQ(t.weight_version(), 0u);
    EXPECT_EQ(t.generate({{3, 4, 5}}, {greedy(4)})[0].logprobs, t_before.logprobs);
    head.bytes = embed.bytes;  // both, equal: accepted
    t.stage_weights({embed, head});
    t.commit_staged_weights(true);
    EXPECT_EQ(t.weight_version(), 1u);
    fs::remove_all(tied);
  }
  const RequestOutput after = e.generate({{3, 4, 5}}, {greedy(5)})[0];
  EXPECT_EQ(after.token_ids, before.token_ids);
  EXPECT_EQ(after.logprobs, before.logprobs);
  EXPECT_EQ(e.weight_version(), 0u);
}

// A subset: tensors not sent keep their values (here only the final norm changes).
TEST(WeightSync, UnsentTensorsKeepTheirValues) {
  const std::string a = test_model("mixtral", "tiny", 0), b = test_model("mixtral", "tiny", 3);
  Engine e(config_for(a));
  std::vector<TensorToWrite> mixed = tensors_of(a), from_b = tensors_of(b);
  std::vector<TensorToWrite> one;
  for (size_t i = 0; i < mixed.size(); ++i)
    if (mixed[i].name == "model.norm.weight") {
      mixed[i] = from_b[i];
      one.push_back(from_b[i]);
    }
  ASSERT_EQ(one.size(), 1u);
  e.stage_weights(one);
  e.commit_staged_weights(true);
  const std::string dir =
      (fs::temp_directory_path() / ("r3_weight_sync_" + std::to_string(getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fs::path(a) / "config.json", fs::path(dir) / "config.json");
  write_safetensors(dir + "/model.safetensors", mixed);
  Engine want(config_for(dir));
  EXPECT_EQ(e.generate({{7, 8, 9}}, {greedy(6)})[0].token_ids,
            want.generate({{7, 8, 9}}, {greedy(6)})[0].token_ids);
  EXPECT_EQ(e.generate({{7, 8, 9}}, {greedy(6)})[0].logprobs,
            want.generate({{7, 8, 9}}, {greedy(6)})[0].logprobs);
  fs::remove_all(dir);
}

// Every view's values, in one vector (the matrices read back from their panels).
std::vector<float> all_values(const ModelWeights& w) {
  std::vector<float> out;
  auto add = [&](const TensorView& t) {
    if (t.empty()) return;
    const std::vector<float> v = t.to_f32();
    out.insert(out.end(), v.begin(), v.end());
  };
  for (const TensorView* t : {&w.embed, &w.final_norm, &w.lm_head}) add(*t);
  for (const LayerWeights& L : w.layers) {
    for (const TensorView* t :
         {&L.input_norm, &L.post_norm, &L.q, &L.k, &L.v, &L.o, &L.router, &L.q_norm, &L.k_norm})
      add(*t);
    for (const ExpertWeights& e : L.experts)
      for (const TensorView* t : {&e.gate, &e.up, &e.down}) add(*t);
  }
  return out;
}

// An update packs the sent tensors into the panels they had: no second copy of the weights, the
// served views keep their addresses, the sent bytes come back to be freed, and once everything
// was sent the checkpoint serves exactly what opening the other checkpoint gives.
TEST(WeightSync, AnUpdateRepacksInPlaceAndHandsBackTheSentBytes) {
  const std::string a = test_model("mixtral", "tiny", 0), b = test_model("mixtral", "tiny", 3);
  std::shared_ptr<Checkpoint> ck = Checkpoint::open(a);
  const uint64_t packed = ck->packed_bytes(), kept = ck->kept_bytes();
  ASSERT_GT(packed, 0u);
  const uint16_t* q0 = ck->weights().layers[0].q.packed;
  ASSERT_NE(q0, nullptr);
  EXPECT_EQ(ck->weights().layers[0].q.data, nullptr);  // the panels are the only copy
  std::vector<TensorToWrite> from_b = tensors_of(b);
  ASSERT_GT(from_b.size(), 2u);
  Checkpoint::Update u = ck->apply_update({from_b[0]});
  EXPECT_EQ(u.replaced.size(), 1u);  // the sent buffer
  std::vector<TensorToWrite> rest(from_b.begin() + 1, from_b.end());
  u = ck->apply_update(std::move(rest));
  EXPECT_GE(u.replaced.size(), from_b.size() - 1);
  EXPECT_EQ(ck->weights().layers[0].q.packed, q0);  // in place
  EXPECT_EQ(ck->packed_bytes(), packed);
  EXPECT_EQ(ck->kept_bytes(), kept);  // the replaced small tensors went back
  EXPECT_EQ(all_values(ck->weights()), all_values(Checkpoint::open(b)->weights()));
  EXPECT_NE(all_values(ck->weights()), all_values(Checkpoint::open(a)->weights()));
  EXPECT_THROW(ck->stored_tensors(),
               Error);  // updated in memory: its stored bytes are kept nowhere
}

}  // namespace
}  // namespace r3

namespace r3 {
namespace {

// A tensor with one element set to `bits` (a bf16 or f32 bit pattern, by the tensor's dtype).
TensorToWrite with_element(TensorToWrite t, size_t element, uint32_t bits) {
  const size_t width = dtype_size(t.dtype);
  if (width == 2) bits = bits >> 16;  // the f32 pattern's bf16 half
  std::memcpy(t.bytes.data() + element * width, &bits, width);
  return t;
}

// Issue 48: a NaN or an infinity in refit weights (from tensors or from disk) is refused naming
// the tensor and the element, before anything changes; the old weights keep serving.
TEST(WeightSync, NonFiniteWeightsAreRefused) {
  const std::string a = testing::test_model("olmoe", "tiny", 0),
                    b = testing::test_model("olmoe", "tiny", 7);
  Engine e(testing::small_config(a));
  const RequestOutput before = e.generate({{3, 4, 5}}, {testing::greedy(5)})[0];
  std::vector<TensorToWrite> good = tensors_of(b);
  size_t head = 0;
  for (size_t i = 0; i < good.size(); ++i)
    if (good[i].name == "lm_head.weight") head = i;
  for (uint32_t bits : {0x7fc00000u, 0x7f800000u, 0xff800000u}) {  // NaN, +inf, -inf
    const size_t last = good[head].bytes.size() / dtype_size(good[head].dtype) - 1;
    for (size_t element : {size_t(0), size_t(13), last}) {
      try {
        e.stage_weights({with_element(good[head], element, bits)});
        ADD_FAILURE() << "accepted";
      } catch (const Error& err) {
        const std::string what = err.what();
        EXPECT_NE(what.find(good[head].name), std::string::npos) << what;
        EXPECT_NE(
            what.find("non-finite value (NaN or infinity) at element " + std::to_string(element)),
            std::string::npos)
            << what;
      }
    }
  }
  EXPECT_EQ(e.staged_weight_tensors(), 0u);
  // From disk: a copy of b with one router row NaN.
  const std::string dir =
      (fs::temp_directory_path() / ("r3_nan_refit_" + std::to_string(getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fs::path(b) / "config.json", fs::path(dir) / "config.json");
  std::vector<TensorToWrite> on_disk = good;
  for (TensorToWrite& t : on_disk)
    if (t.name == "model.layers.0.mlp.gate.weight") t = with_element(t, 5, 0x7fc00000u);
  write_safetensors(dir + "/model.safetensors", on_disk);
  // A refit from disk is in place, a layer at a time: values are checked as each layer is read,
  // after the embedding and lm_head changed. No mix is served: requests are refused, naming the
  // failed refit, until a refit succeeds.
  try {
    e.update_weights(dir, false);
    ADD_FAILURE() << "accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model.layers.0.mlp.gate.weight"), std::string::npos)
        << err.what();
    EXPECT_NE(std::string(err.what()).find("failed after the served weights began to change"),
              std::string::npos)
        << err.what();
  }
  EXPECT_EQ(e.weight_version(), 0u);
  EXPECT_FALSE(e.failed_refit().empty());
  try {
    e.generate({{3, 4, 5}}, {testing::greedy(5)});
    ADD_FAILURE() << "served a mix of two weight sets";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("the refit from " + dir + " failed"), std::string::npos)
        << err.what();
  }
  // A bucket that does not send every weight leaves the mix refused; a good refit serves again.
  e.stage_weights({good[head]});
  e.commit_staged_weights(false);
  EXPECT_THROW(e.generate({{3, 4, 5}}, {testing::greedy(5)}), Error);
  e.update_weights(a, false);
  EXPECT_TRUE(e.failed_refit().empty());
  fs::remove_all(dir);
  const RequestOutput after = e.generate({{3, 4, 5}}, {testing::greedy(5)})[0];
  EXPECT_EQ(after.token_ids, before.token_ids);
  EXPECT_EQ(after.logprobs, before.logprobs);
}

// Issue 48: KV computed under one weight version is never a prefix hit under another, even when
// the refit keeps the cache (flush false): the repeated prompt equals a fresh engine's run on the
// new weights, and every token carries the new version.
TEST(WeightSync, PrefixHitsNeverCrossAWeightVersion) {
  const std::string a = testing::test_model("olmoe", "tiny", 0),
                    b = testing::test_model("olmoe", "tiny", 7);
  EngineConfig c = testing::small_config(a);
  c.enable_prefix_caching = true;
  Engine e(c);
  std::vector<int> prompt;
  for (int i = 0; i < 4 * c.block_size + 3; ++i) prompt.push_back(3 + (i * 7) % 50);
  e.generate({prompt}, {testing::greedy(3)});
  e.generate({prompt}, {testing::greedy(3)});
  const uint64_t hits_before = e.stats().prefix_hit_tokens;
  EXPECT_GT(hits_before, 0u);  // the cache works within one version
  e.stage_weights(tensors_of(b));
  e.commit_staged_weights(false);
  const RequestOutput got = e.generate({prompt}, {testing::greedy(6)})[0];
  EXPECT_EQ(e.stats().prefix_hit_tokens, hits_before);  // no hit on version-0 blocks
  EngineConfig fc = testing::small_config(b);
  fc.enable_prefix_caching = true;
  Engine fresh(fc);
  const RequestOutput want = fresh.generate({prompt}, {testing::greedy(6)})[0];
  EXPECT_EQ(got.token_ids, want.token_ids);
  EXPECT_EQ(got.logprobs, want.logprobs);
  for (uint64_t v : got.weight_versions) EXPECT_EQ(v, 1u);
  // Within the new version the cache works again.
  e.generate({prompt}, {testing::greedy(3)});
  EXPECT_GT(e.stats().prefix_hit_tokens, hits_before);
}

}  // namespace
}  // namespace r3
