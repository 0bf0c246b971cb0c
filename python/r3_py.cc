// The Python module `r3`: a vLLM-like offline API over one Engine.
//
//   import r3
//   llm = r3.LLM(model="DIR", enable_return_routed_experts=True, max_num_seqs=32, ...)
//   outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}], r3.SamplingParams(max_tokens=8, seed=1))
//   outs[0].outputs[0].token_ids        # list[int]
//   outs[0].outputs[0].logprobs         # list[float], the sampled tokens' logprobs
//   outs[0].outputs[0].routed_experts   # numpy [S-1, L_moe, K], rows from routed_experts_start
//   llm.update_weights("DIR2")          # refit; llm.weight_version increases
//
// The GIL is released while the engine runs; one LLM serialises its callers (the engine is
// single-threaded). Engine errors raise r3.Error (a ValueError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "engine/request_fields.h"
#include "model/config_json.h"
#include "model/families.h"
#include "routes/route_formats.h"
#include "serving/channel.h"
#include "serving/engine_loop.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace py = pybind11;

namespace {

using r3::EngineConfig;
using r3::RequestOutput;

// A seed is None or an int in [0, 2**64): anything else is an r3.Error naming the field (not
// pybind's TypeError listing the constructor's signature).
std::optional<uint64_t> seed_of(const py::object& seed) {
  if (seed.is_none()) return std::nullopt;
  if (!py::isinstance<py::int_>(seed) || py::isinstance<py::bool_>(seed))
    throw r3::Error("seed must be an int in [0, 2**64) or None, not " +
                    std::string(py::str(py::type::of(seed).attr("__name__"))));
  const unsigned long long v = PyLong_AsUnsignedLongLong(seed.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw r3::Error("seed must be in [0, 2**64); got " + std::string(py::str(seed)).substr(0, 40));
  }
  return uint64_t(v);
}

// SamplingParams with return_routed_experts left open (None = as the LLM was started).
struct PySamplingParams {
  r3::SamplingParams p;
  int n = 1;                           // samples per prompt (seed + j, or fresh seeds)
  std::optional<int> logprobs;         // vLLM: top alternatives per generated token
  std::optional<int> prompt_logprobs;  // vLLM: score the prompt, with this many alternatives
  std::optional<bool> return_routed_experts;
  // None (vLLM's default): every request draws a fresh random seed, so the samples of one
  // batch differ. A fixed seed makes a request reproducible.
  std::optional<uint64_t> seed;
  // vLLM's name for the route cut (vllm #51906): routed_experts_start, within the prompt.
  std::optional<int> routed_experts_prompt_start;
  // The prompt's length is known only with the prompt.
  void check_prompt_start(size_t prompt_len) const {
    if (routed_experts_prompt_start && size_t(*routed_experts_prompt_start) > prompt_len)
      throw r3::Error("routed_experts_prompt_start " +
                      std::to_string(*routed_experts_prompt_start) + " is past the prompt's " +
                      std::to_string(prompt_len) + " tokens (it cuts the prompt's routes only)");
  }
};

struct CompletionOutput {
  int index = 0;
  std::string text;  // the detokenised output ("" when the model has no tokenizer)
  py::object stop_reason = py::none();  // vLLM: the matched stop string or stop token id
  std::vector<int> token_ids;
  std::vector<float> logprobs;
  double cumulative_logprob = 0.0;
  std::string finish_reason;
  std::vector<uint64_t> weight_versions;
  py::object routed_experts = py::none();  // numpy int16 [rows, L_moe, K] or None
  // SamplingParams(return_routed_expert_weights=True): numpy float32 [rows, L_moe, K], each
  // chosen expert's gate weight in the ids' order; else None.
  py::object routed_expert_weights = py::none();
  int routed_experts_start = 0;
  std::vector<int> moe_layers;
  py::object top_logprobs =
      py::none();  // SamplingParams(logprobs=k): [{token_id: logprob}] per token
};

struct PyRequestOutput {
  std::string request_id;
  std::vector<int> prompt_token_ids;
  std::vector<CompletionOutput> outputs;
  bool finished = true;
  int num_cached_tokens = 0;
  // SamplingParams(prompt_logprobs=k): vLLM's list, one entry per prompt position: None for
  // position 0, else {token_id: logprob} holding the prompt token and the k best alternatives.
  py::object prompt_logprobs = py::none();
  // The prompt part of the routes (rows [start, P)), as vLLM's RequestOutput.prompt_routed_experts.
  py::object prompt_routed_experts = py::none();
  py::object prompt_routed_expert_weights = py::none();  // their gate weights, when asked for
  py::object routed_experts() const {
    return outputs.empty() ? py::none() : outputs[0].routed_experts;
  }
};

// The model description as LLM.model_config and r3.torch (_parse_model_config) read it.
py::dict config_dict(const r3::ModelConfig& c) {
  // Every field (r3::model_config_json: nested by dotted name, an absent part None).
  py::dict d = py::module_::import("json").attr("loads")(r3::model_config_json(c).dump());
  // Derived and earlier flat names, kept for callers that read them.
  d["moe_layers"] = c.moe_layers();
  d["renormalize"] = c.router.renormalize;
  d["routed_scaling_factor"] = c.router.routed_scaling_factor;
  return d;
}

py::object routes_to_numpy(const r3::RouteArray& r) {
  py::array_t<int16_t> a({py::ssize_t(r.rows), py::ssize_t(r.layers), py::ssize_t(r.k)});
  if (!r.data.empty())
    std::memcpy(a.mutable_data(), r.data.data(), r.data.size() * sizeof(int16_t));
  return a;
}

// The gate weights of r as float32 [rows, layers, k], or None when r carries none.
py::object route_weights_to_numpy(const r3::RouteArray& r) {
  if (!r.has_weights()) return py::none();
  py::array_t<float> a({py::ssize_t(r.rows), py::ssize_t(r.layers), py::ssize_t(r.k)});
  std::memcpy(a.mutable_data(), r.weights.data(), r.weights.size() * sizeof(float));
  return a;
}

// An engine output as vLLM's RequestOutput (one CompletionOutput); a failed request raises.
// vllm_split: CompletionOutput.routed_experts holds the generated rows [P, S-1) only, as vLLM's
// does (the prompt rows are in prompt_routed_experts either way); otherwise all rows (r3).
PyRequestOutput to_python(RequestOutput&& o, const std::string& request_id, bool vllm_split) {
  if (!o.error.empty()) throw r3::Error("request " + request_id + ": " + o.error);
  if (!o.routes_error.empty())
    throw r3::Error("request " + request_id + ": routes are incomplete (" + o.routes_error + ")");
  PyRequestOutput r;
  r.request_id = request_id;
  r.prompt_token_ids = std::move(o.prompt_token_ids);
  r.num_cached_tokens = o.num_cached_tokens;
  r.finished = o.finished;
  auto top_dict = [](const r3::TopLogprobs& t, py::dict d) {
    for (int j = 0; j < t.n; ++j) d[py::int_(t.ids[j])] = t.logprobs[j];
    return d;
  };
  if (o.prompt_logprobs_start >= 0) {
    py::list pl;
    for (int p = 0; p < o.prompt_logprobs_start; ++p) pl.append(py::none());
    for (size_t i = 0; i < o.prompt_logprobs.size(); ++i) {
      const size_t pos = size_t(o.prompt_logprobs_start) + i;
      if (pos == 0) {
        pl.append(py::none());
        continue;
      }
      py::dict d;
      if (!o.prompt_top_logprobs.empty()) top_dict(o.prompt_top_logprobs[i], d);
      d[py::int_(r.prompt_token_ids[pos])] = o.prompt_logprobs[i];
      pl.append(d);
    }
    r.prompt_logprobs = pl;
  }
  CompletionOutput c;
  if (!o.top_logprobs.empty()) {
    py::list tl;
    for (size_t i = 0; i < o.top_logprobs.size(); ++i) {
      py::dict d;
      top_dict(o.top_logprobs[i], d);
      d[py::int_(o.token_ids[i])] = o.logprobs[i];
      tl.append(d);
    }
    c.top_logprobs = tl;
  }
  c.text = o.text;
  if (o.finish_reason == "stop")
    c.stop_reason = !o.stop_str.empty()   ? py::object(py::str(o.stop_str))
                    : o.token_ids.empty() ? py::none()
                                          : py::object(py::int_(o.token_ids.back()));
  c.token_ids = std::move(o.token_ids);
  c.logprobs = std::move(o.logprobs);
  for (float f : c.logprobs) c.cumulative_logprob += double(f);
  c.finish_reason = o.finish_reason;
  c.weight_versions = std::move(o.weight_versions);
  if (o.routed_experts) {
    const int P = int(r.prompt_token_ids.size());
    const r3::RouteArray prompt = r3::route_rows(*o.routed_experts, o.routed_experts->start, P);
    r.prompt_routed_experts = routes_to_numpy(prompt);
    r.prompt_routed_expert_weights = route_weights_to_numpy(prompt);
    const r3::RouteArray generated =
        r3::route_rows(*o.routed_experts, P, o.routed_experts->start + o.routed_experts->rows);
    c.routed_experts = routes_to_numpy(vllm_split ? generated : *o.routed_experts);
    c.routed_expert_weights = route_weights_to_numpy(vllm_split ? generated : *o.routed_experts);
    c.routed_experts_start = vllm_split ? generated.start : o.routed_experts->start;
    c.moe_layers = o.routed_experts->moe_layers;
  }
  r.outputs.push_back(std::move(c));
  return r;
}

// named: a dict {name: array} or a list of (name, array). Arrays: anything with the buffer
// protocol, C-contiguous; float32 -> F32, float16 -> F16, 16-bit integers -> the bits of BF16
// (numpy has no bfloat16: send `tensor.view(torch.int16).numpy()`), 8-bit integers -> bytes (U8:
// MXFP4 blocks and scales, or the codes of an F8_E4M3 weight, which numpy lacks too).
std::vector<r3::TensorToWrite> tensors_from_python(const py::object& named) {
  std::vector<r3::TensorToWrite> tensors;
  auto add = [&](const py::handle& name, const py::handle& arr) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(arr).request();
    r3::TensorToWrite t;
    t.name = name.cast<std::string>();
    const std::string f = info.format;
    if (f == "f" && info.itemsize == 4)
      t.dtype = r3::DType::F32;
    else if (f == "e" && info.itemsize == 2)
      t.dtype = r3::DType::F16;
    else if ((f == "H" || f == "h") && info.itemsize == 2)
      t.dtype = r3::DType::BF16;
    else if ((f == "B" || f == "b") && info.itemsize == 1)
      t.dtype = r3::DType::U8;
    else
      throw r3::Error("update_weights_from_tensors: tensor \"" + t.name + "\" has buffer format '" +
                      f +
                      "' (give float32, float16, int16/uint16 holding bf16 bits, or uint8 bytes)");
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t i = info.ndim - 1; i >= 0; --i) {
      if (info.strides[size_t(i)] != expect)
        throw r3::Error("update_weights_from_tensors: tensor \"" + t.name +
                        "\" is not C-contiguous");
      expect *= info.shape[size_t(i)];
      t.shape.insert(t.shape.begin(), int64_t(info.shape[size_t(i)]));
    }
    const auto* p = static_cast<const uint8_t*>(info.ptr);
    t.bytes.assign(p, p + size_t(info.size * info.itemsize));
    tensors.push_back(std::move(t));
  };
  if (py::isinstance<py::dict>(named)) {
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(named)) add(k, v);
  } else {
    for (auto item : py::list(named)) {
      py::tuple pair = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
      if (pair.size() != 2)
        throw r3::Error("update_weights_from_tensors: give (name, array) pairs or a dict");
      add(pair[0], pair[1]);
    }
  }
  return tensors;
}

// Python values as JSON, dict keys in insertion order (chat messages and tool schemas).
nlohmann::ordered_json to_ojson(const py::handle& o) {
  if (o.is_none()) return nullptr;
  if (py::isinstance<py::bool_>(o)) return o.cast<bool>();
  if (py::isinstance<py::int_>(o)) return o.cast<int64_t>();
  if (py::isinstance<py::float_>(o)) return o.cast<double>();
  if (py::isinstance<py::str>(o)) return o.cast<std::string>();
  if (py::isinstance<py::dict>(o)) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(o))
      j[py::str(k).cast<std::string>()] = to_ojson(v);
    return j;
  }
  if (py::isinstance<py::list>(o) || py::isinstance<py::tuple>(o)) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (auto v : o) j.push_back(to_ojson(v));
    return j;
  }
  throw r3::Error("cannot pass a " + py::str(o.get_type()).cast<std::string>() +
                  " to a chat template");
}

// A prompt: text (encoded with the model's tokenizer, its special tokens added as Hugging
// Face's tokenizer(text) does), {"prompt": text}, {"prompt_token_ids": [...]} or a list of ids.
std::vector<int> prompt_of(const py::handle& item, const r3::text::Tokenizer* tok) {
  auto encode = [&](const std::string& text) {
    if (!tok)
      throw r3::Error(
          "the model has no tokenizer (no tokenizer.json; pass tokenizer=DIR); pass token ids");
    const std::vector<int32_t> ids = tok->encode(text, true);
    return std::vector<int>(ids.begin(), ids.end());
  };
  if (py::isinstance<py::str>(item)) return encode(item.cast<std::string>());
  if (py::isinstance<py::dict>(item)) {
    py::dict d = py::reinterpret_borrow<py::dict>(item);
    if (d.contains("prompt_token_ids")) return d["prompt_token_ids"].cast<std::vector<int>>();
    if (d.contains("prompt")) return encode(d["prompt"].cast<std::string>());
    throw r3::Error("a prompt dict needs \"prompt_token_ids\" or \"prompt\"");
  }
  return item.cast<std::vector<int>>();  // a plain list of ids
}

// r3.Tokenizer: a Hugging Face tokenizer.json (encode, decode, apply_chat_template).
struct PyTokenizer {
  std::shared_ptr<const r3::text::Tokenizer> tok;

  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const {
    return tok->encode(text, add_special_tokens);
  }
  std::string decode(const py::object& ids, bool skip_special_tokens) const {
    return tok->decode(ids.cast<std::vector<int32_t>>(), skip_special_tokens);
  }
  py::object apply_chat_template(const py::object& messages, bool tokenize,
                                 bool add_generation_prompt, bool continue_final_message,
                                 const py::object& tools, const py::object& chat_template,
                                 const py::kwargs& kwargs) const {
    r3::text::ChatRequest r;
    r.messages = to_ojson(messages);
    r.tools = to_ojson(tools);
    r.add_generation_prompt = add_generation_prompt;
    r.continue_final_message = continue_final_message;
    r.kwargs = nlohmann::ordered_json::object();
    for (auto [k, v] : kwargs) {
      const std::string key = k.cast<std::string>();
      if (key == "chat_template_kwargs") {
        for (auto [k2, v2] : v.cast<py::dict>()) r.kwargs[k2.cast<std::string>()] = to_ojson(v2);
      } else {
        r.kwargs[key] = to_ojson(v);
      }
    }
    const r3::text::ChatTemplate ct(
        tok, chat_template.is_none() ? "" : chat_template.cast<std::string>());
    if (!tokenize) return py::str(ct.render(r));
    return py::cast(ct.encode(r));
  }
};

class LLM {
 public:
  explicit LLM(const std::string& model, bool enable_routes, const py::kwargs& kw) {
    EngineConfig c = engine_config(model, enable_routes, kw, "LLM");
    vllm_split_ = vllm_split_from(kw);
    py::gil_scoped_release nogil;
    engine_ = std::make_unique<r3::Engine>(c);
  }

  // routed_experts_format="r3" (default: all S-1 rows on the CompletionOutput) or "vllm".
  static bool vllm_split_from(const py::kwargs& kw) {
    if (!kw.contains("routed_experts_format")) return false;
    const std::string f = kw["routed_experts_format"].cast<std::string>();
    if (f != "r3" && f != "vllm")
      throw r3::Error("routed_experts_format must be \"r3\" or \"vllm\", got \"" + f + "\"");
    return f == "vllm";
  }

  static EngineConfig engine_config(const std::string& model, bool enable_routes,
                                    const py::kwargs& kw, const char* who) {
    EngineConfig c;
    c.model = model;
    c.enable_return_routed_experts = enable_routes;
    for (auto [k, v] : kw) {
      const std::string key = k.cast<std::string>();
      if (key == "block_size")
        c.block_size = v.cast<int>();
      else if (key == "num_kv_blocks")
        c.num_kv_blocks = v.cast<int>();
      else if (key == "kv_cache_mb")
        c.kv_cache_mb = v.cast<int>();
      else if (key == "kv_cache_dtype")
        c.kv_cache_dtype = v.cast<std::string>();
      else if (key == "max_num_seqs")
        c.max_num_seqs = v.cast<int>();
      else if (key == "max_num_batched_tokens")
        c.max_num_batched_tokens = v.cast<int>();
      else if (key == "enable_prefix_caching")
        c.enable_prefix_caching = v.cast<bool>();
      else if (key == "max_state_snapshots")
        c.max_state_snapshots = v.cast<int>();
      else if (key == "overlap_scheduler")
        c.overlap_scheduler = v.cast<bool>();
      else if (key == "decode_buckets")
        c.decode_buckets = v.cast<std::vector<int>>();
      else if (key == "threads")
        c.threads = v.cast<int>();
      else if (key == "eplb_redundant_experts")
        c.eplb_redundant_experts = v.cast<int>();
      // Refused by the engine with what to run instead: expert parallelism needs `mpirun r3`.
      else if (key == "expert_parallel")
        c.expert_parallel = v.cast<int>();
      else if (key == "tokenizer")
        c.tokenizer = v.cast<std::string>();
      else if (key == "speculative_algorithm")
        c.speculative_algorithm = v.is_none() ? "" : v.cast<std::string>();
      else if (key == "speculative_num_draft_tokens")
        c.speculative_num_draft_tokens = v.cast<int>();
      else if (key == "speculative_ngram_min_match_window_size")
        c.speculative_ngram_min_match_window_size = v.cast<int>();
      else if (key == "speculative_ngram_max_match_window_size")
        c.speculative_ngram_max_match_window_size = v.cast<int>();
      else if (key == "speculative_disable_by_batch_size")
        c.speculative_disable_by_batch_size = v.cast<int>();
      else if (key == "routed_experts_format")
        continue;  // the Python side's (vllm_split_from)
      else
        throw py::type_error(std::string(who) + "() got an unknown engine argument '" + key + "'");
    }
    return c;
  }

  std::vector<PyRequestOutput> generate(const py::object& prompts, const py::object& params) {
    // Prompts: one dict / id list, or a list of them.
    std::vector<std::vector<int>> ps;
    if (py::isinstance<py::dict>(prompts) || py::isinstance<py::str>(prompts)) {
      ps.push_back(prompt_of(prompts, engine_->tokenizer().get()));
    } else {
      py::list l = py::list(prompts);
      if (l.size() > 0 && !py::isinstance<py::dict>(l[0]) && !py::isinstance<py::str>(l[0]) &&
          !py::isinstance<py::list>(l[0]) && !py::isinstance<py::tuple>(l[0]))
        ps.push_back(prompt_of(prompts, engine_->tokenizer().get()));  // a single list of ids
      else
        for (auto item : l) ps.push_back(prompt_of(item, engine_->tokenizer().get()));
    }
    std::vector<PySamplingParams> per_prompt;
    if (params.is_none() || py::isinstance<PySamplingParams>(params)) {
      const PySamplingParams one =
          params.is_none() ? PySamplingParams{} : params.cast<PySamplingParams>();
      per_prompt.assign(ps.size(), one);
    } else {
      for (auto item : py::list(params)) per_prompt.push_back(item.cast<PySamplingParams>());
      if (per_prompt.size() != ps.size())
        throw r3::Error("give one SamplingParams or one per prompt");
    }
    // n samples of a prompt are n engine requests: seeds seed + j, or fresh ones.
    std::vector<std::vector<int>> requests;
    std::vector<r3::SamplingParams> sp;
    for (size_t i = 0; i < ps.size(); ++i)
      for (int j = 0; j < per_prompt[i].n; ++j) {
        per_prompt[i].check_prompt_start(ps[i].size());
        r3::SamplingParams p = per_prompt[i].p;
        p.seed = per_prompt[i].seed ? *per_prompt[i].seed + uint64_t(j) : fresh_seeds_();
        p.return_routed_experts = per_prompt[i].return_routed_experts.value_or(
            engine_->config().enable_return_routed_experts);
        requests.push_back(ps[i]);
        sp.push_back(p);
      }
    std::vector<RequestOutput> outs;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(mu_);
      outs = engine_->generate(requests, sp);
    }
    std::vector<PyRequestOutput> res;
    size_t k = 0;
    for (size_t i = 0; i < ps.size(); ++i)
      for (int j = 0; j < per_prompt[i].n; ++j, ++k) {
        PyRequestOutput r =
            to_python(std::move(outs[k]), std::to_string(outs[k].request_id), vllm_split_);
        r.outputs[0].index = j;
        if (j == 0)
          res.push_back(std::move(r));
        else
          res.back().outputs.push_back(std::move(r.outputs[0]));
      }
    return res;
  }

  // vLLM's LLM.chat: one conversation (a list of messages) or a list of them, rendered with the
  // model's chat template (or chat_template), then generated as token-id prompts.
  std::vector<PyRequestOutput> chat(const py::object& messages, const py::object& params,
                                    const py::object& chat_template, bool add_generation_prompt,
                                    bool continue_final_message, const py::object& tools,
                                    const py::object& chat_template_kwargs) {
    const PyTokenizer t = get_tokenizer();
    py::list conversations;
    py::list l(messages);
    if (l.size() > 0 && (py::isinstance<py::list>(l[0]) || py::isinstance<py::tuple>(l[0])))
      conversations = l;
    else
      conversations.append(l);
    py::list prompts;
    py::kwargs kw;
    if (!chat_template_kwargs.is_none()) kw["chat_template_kwargs"] = chat_template_kwargs;
    for (auto conv : conversations)
      prompts.append(
          py::dict(py::arg("prompt_token_ids") = t.apply_chat_template(
                       py::reinterpret_borrow<py::object>(conv), true, add_generation_prompt,
                       continue_final_message, tools, chat_template, kw)));
    return generate(prompts, params);
  }

  PyTokenizer get_tokenizer() const {
    if (!engine_->tokenizer())
      throw r3::Error(
          "the model has no tokenizer (no tokenizer.json in the checkpoint; pass tokenizer=DIR)");
    return PyTokenizer{engine_->tokenizer()};
  }

  void update_weights(const std::string& path, bool flush_cache) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lk(mu_);
    engine_->update_weights(path, flush_cache);
  }

  size_t update_weights_from_tensors(const py::object& named, bool flush_cache, bool finished) {
    std::vector<r3::TensorToWrite> tensors = tensors_from_python(named);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lk(mu_);
    engine_->stage_weights(std::move(tensors));
    const size_t n = engine_->staged_weight_tensors();
    if (finished) engine_->commit_staged_weights(flush_cache);
    return n;
  }

  uint64_t weight_version() {
    std::lock_guard<std::mutex> lk(mu_);
    return engine_->weight_version();
  }

  py::dict stats() {
    r3::EngineStats s;
    {
      std::lock_guard<std::mutex> lk(mu_);
      s = engine_->stats();
    }
    py::dict d;
    d["steps"] = s.steps;
    d["prompt_tokens"] = s.prompt_tokens;
    d["generated_tokens"] = s.generated_tokens;
    d["computed_tokens"] = s.computed_tokens;
    d["preemptions"] = s.preemptions;
    d["prefix_hit_tokens"] = s.prefix_hit_tokens;
    d["spec_draft_tokens"] = s.spec_draft_tokens;
    d["spec_accepted_tokens"] = s.spec_accepted_tokens;
    d["spec_acceptance_rate"] =
        s.spec_draft_tokens ? double(s.spec_accepted_tokens) / double(s.spec_draft_tokens) : 0.0;
    d["spec_steps_off"] = s.spec_steps_off;
    d["prefix_queried_tokens"] = s.prefix_queried_tokens;
    d["route_bytes_returned"] = s.route_bytes_returned;
    d["capture_waits"] = s.capture_waits;
    d["routed_experts_gaps"] = s.routed_experts_gaps;
    d["requests_finished"] = s.requests_finished;
    d["requests_aborted"] = s.requests_aborted;
    d["weight_version"] = s.weight_version;
    d["running"] = s.running;
    d["waiting"] = s.waiting;
    d["free_blocks"] = s.free_blocks;
    d["num_blocks"] = s.num_blocks;
    d["free_window_blocks"] = s.free_window_blocks;
    d["num_window_blocks"] = s.num_window_blocks;
    d["window_blocks_freed"] = s.window_blocks_freed;
    d["state_snapshots"] = s.state_snapshots;
    d["state_snapshots_held"] = s.state_snapshots_held;
    d["state_snapshots_taken"] = s.state_snapshots_taken;
    d["state_snapshot_restores"] = s.state_snapshot_restores;
    d["state_snapshot_cut_tokens"] = s.state_snapshot_cut_tokens;
    d["state_snapshot_bytes"] = s.state_snapshot_bytes;
    d["recurrent_state_bytes_per_request"] = s.recurrent_state_bytes_per_request;
    d["block_size"] = s.block_size;
    d["kv_cache_dtype"] = s.kv_cache_dtype;
    d["expert_load"] = s.expert_load;
    d["moe_layers"] = s.moe_layers;
    return d;
  }

  py::dict model_config() { return config_dict(engine_->model_config()); }

 private:
  bool vllm_split_ = false;
  std::mutex mu_;
  std::unique_ptr<r3::Engine> engine_;
  std::mt19937_64 fresh_seeds_{std::random_device{}()};
};

// One request's stream of cumulative outputs (AsyncLLM.generate reads it from a worker thread).
class PyStream {
 public:
  PyStream(std::shared_ptr<r3::serving::Channel> ch, std::string request_id, bool vllm_split)
      : ch_(std::move(ch)), request_id_(std::move(request_id)), vllm_split_(vllm_split) {}
  // The newest output, or None when nothing new came within timeout_s (GIL released meanwhile).
  py::object next(double timeout_s) {
    std::vector<std::optional<RequestOutput>> outs;
    bool got = false;
    std::string failure;
    {
      py::gil_scoped_release nogil;
      got = ch_->take(seen_, std::chrono::milliseconds(int64_t(timeout_s * 1000)), outs);
      failure = ch_->failure();
    }
    if (!failure.empty()) throw r3::Error("request " + request_id_ + ": " + failure);
    if (!got || outs.empty() || !outs[0]) return py::none();
    return py::cast(to_python(std::move(*outs[0]), request_id_, vllm_split_));
  }

 private:
  std::shared_ptr<r3::serving::Channel> ch_;
  std::string request_id_;
  bool vllm_split_;
  uint64_t seen_ = 0;
};

// The engine behind r3.AsyncLLM: its own loop thread (r3::serving::EngineLoop, as `r3 serve`
// uses), so requests are added, aborted and streamed while others run.
class AsyncEngine {
 public:
  AsyncEngine(const std::string& model, bool enable_routes, const py::kwargs& kw) {
    EngineConfig c = LLM::engine_config(model, enable_routes, kw, "AsyncLLM");
    vllm_split_ = LLM::vllm_split_from(kw);
    py::gil_scoped_release nogil;
    loop_ = std::make_unique<r3::serving::EngineLoop>(c);
  }
  ~AsyncEngine() {
    py::gil_scoped_release nogil;
    loop_.reset();
  }

  PyStream submit(const py::object& prompt, const py::object& params,
                  const std::string& request_id) {
    PySamplingParams sp = params.is_none() ? PySamplingParams{} : params.cast<PySamplingParams>();
    if (sp.n != 1)
      throw r3::Error(
          "AsyncLLM.generate takes n = 1 (one request id per sample, as vLLM's AsyncLLM)");
    r3::serving::Job j{prompt_of(prompt, loop_->tokenizer().get()), sp.p};
    sp.check_prompt_start(j.prompt.size());
    j.params.seed = sp.seed ? *sp.seed : fresh_seeds_();
    j.params.return_routed_experts =
        sp.return_routed_experts.value_or(loop_->engine_config().enable_return_routed_experts);
    auto ch = std::make_shared<r3::serving::Channel>(1, true);
    std::vector<r3::serving::Job> jobs;
    jobs.push_back(std::move(j));
    {
      py::gil_scoped_release nogil;
      try {
        loop_->submit(std::move(jobs), ch, request_id);
      } catch (const r3::serving::SubmitError& e) {
        throw r3::Error(e.what());
      } catch (const r3::serving::ServingError& e) {
        throw r3::Error(e.what());
      }
    }
    return PyStream(ch, request_id, vllm_split_);
  }

  // The rest release the GIL while the loop thread does the work.
  size_t abort(const std::string& request_id) {
    return nogil([&] { return loop_->abort_rid(request_id); });
  }
  void pause_generation(const std::string& mode) {
    nogil([&] {
      loop_->pause_generation(mode);
      return 0;
    });
  }
  void continue_generation() {
    nogil([&] {
      loop_->continue_generation();
      return 0;
    });
  }
  bool reset_prefix_cache() {
    return nogil([&] { return loop_->flush_cache(); });
  }
  void sleep(int level) {
    if (level != 1 && level != 2) throw r3::Error("sleep: level must be 1 or 2");
    nogil([&] {
      loop_->release_memory(true, true);
      return 0;
    });
  }
  void wake_up(const std::optional<std::vector<std::string>>& tags) {
    bool kv = !tags, weights = !tags;
    for (const std::string& t : tags.value_or(std::vector<std::string>{})) {
      if (t == "kv_cache")
        kv = true;
      else if (t == "weights")
        weights = true;
      else
        throw r3::Error("wake_up: unknown tag \"" + t + "\" (kv_cache, weights)");
    }
    nogil([&] {
      loop_->resume_memory(kv, weights);
      return 0;
    });
  }
  uint64_t update_weights(const std::string& path, bool flush_cache,
                          const std::optional<std::string>& version) {
    return nogil([&] { return loop_->update_weights(path, flush_cache, version); });
  }
  size_t update_weights_from_tensors(const py::object& named, bool flush_cache,
                                     const std::optional<std::string>& version, bool finished) {
    std::vector<r3::TensorToWrite> tensors = tensors_from_python(named);
    return nogil([&] {
      return loop_
          ->update_weights_from_tensors(std::move(tensors), flush_cache, version, finished, false)
          .first;
    });
  }
  std::string get_weight_version() { return loop_->weight_label(); }
  bool is_paused() { return loop_->paused(); }

 private:
  template <class F>
  auto nogil(F f) -> decltype(f()) {
    py::gil_scoped_release release;
    try {
      return f();
    } catch (const r3::serving::ServingError& e) {
      throw r3::Error(e.what());
    }
  }
  std::unique_ptr<r3::serving::EngineLoop> loop_;
  bool vllm_split_ = false;
  std::mt19937_64 fresh_seeds_{std::random_device{}()};
};

}  // namespace

void bind_staging(py::module_& m);  // python/staging_py.cc

PYBIND11_MODULE(_r3, m) {
  m.doc() = "r3: MoE inference with Rollout Routing Replay (routes of every token, per MoE layer)";
  py::register_exception<r3::Error>(m, "Error", PyExc_ValueError);
  // r3's own parse of a config.json (text), for r3.torch: the values the engine computes with,
  // defaults included, so the trainer's forward never falls back to defaults of its own.
  m.def(
      "_parse_model_config",
      [](const std::string& json_text) {
        return config_dict(r3::parse_config(json_text, "config.json"));
      },
      py::arg("json_text"));
  // The family registry (model/families.h): {HF model class: r3's family name}, every class r3
  // reads, so r3.torch serves exactly the engine's families.
  m.def("_families", [] {
    py::dict d;
    for (const r3::Family& f : r3::families())
      for (const char* c : f.hf_classes) d[py::str(c)] = f.name;
    return d;
  });
  // The request vocabulary (engine/request_fields.h): per option, its name in each front end
  // ("" where it takes none; "a|b": either), so the Python keyword names are checked against it.
  m.def("_request_fields", [] {
    static const char* kFrontEnds[] = {"completions", "chat", "generate", "jsonl", "python"};
    py::list out;
    for (const r3::RequestField& row : r3::request_fields()) {
      py::dict names;
      for (int f = 0; f < r3::kFrontEnds; ++f) names[kFrontEnds[f]] = row.names[size_t(f)];
      out.append(py::dict(py::arg("option") = row.option, py::arg("names") = names));
    }
    return out;
  });
  py::module_ staging =
      m.def_submodule("_staging", "r3.staging's native half (python/staging_py.cc)");
  bind_staging(staging);

  py::class_<PySamplingParams>(m, "SamplingParams")
      .def(
          py::init([](int max_tokens, float temperature, float top_p, int top_k,
                      const py::object& seed, std::vector<int> stop_token_ids, bool ignore_eos,
                      std::optional<bool> return_routed_experts, int routed_experts_start, int n,
                      std::optional<int> logprobs, std::optional<int> prompt_logprobs,
                      const py::object& stop, bool include_stop_str_in_output,
                      bool skip_special_tokens, std::optional<int> routed_experts_prompt_start,
                      bool return_routed_expert_weights) {
            PySamplingParams s;
            if (routed_experts_prompt_start) {
              if (routed_experts_start != 0)
                throw r3::Error("give one of routed_experts_start and routed_experts_prompt_start");
              if (*routed_experts_prompt_start < 0)
                throw r3::Error("routed_experts_prompt_start must be >= 0");
              routed_experts_start = *routed_experts_prompt_start;
              s.routed_experts_prompt_start = routed_experts_prompt_start;
            }
            if (py::isinstance<py::str>(stop))
              s.p.stop = {stop.cast<std::string>()};
            else if (!stop.is_none())
              s.p.stop = stop.cast<std::vector<std::string>>();
            s.p.include_stop_str_in_output = include_stop_str_in_output;
            s.p.skip_special_tokens = skip_special_tokens;
            if (n < 1) throw r3::Error("n must be >= 1");
            s.n = n;
            s.logprobs = logprobs;
            s.prompt_logprobs = prompt_logprobs;
            s.p.top_logprobs = std::max(logprobs.value_or(0), prompt_logprobs.value_or(0));
            s.p.prompt_logprobs_start = prompt_logprobs ? 0 : -1;
            s.p.max_tokens = max_tokens;
            s.p.temperature = temperature;
            s.p.top_p = top_p;
            s.p.top_k = top_k;
            s.seed = seed_of(seed);
            s.p.stop_token_ids = std::move(stop_token_ids);
            s.p.ignore_eos = ignore_eos;
            s.p.logprobs = true;
            s.p.routed_experts_start = routed_experts_start;
            s.return_routed_experts = return_routed_experts;
            s.p.return_routed_expert_weights = return_routed_expert_weights;
            return s;
          }),
          py::kw_only(), py::arg("max_tokens") = 16, py::arg("temperature") = 1.0f,
          py::arg("top_p") = 1.0f, py::arg("top_k") = 0, py::arg("seed") = py::none(),
          py::arg("stop_token_ids") = std::vector<int>{}, py::arg("ignore_eos") = false,
          py::arg("return_routed_experts") = py::none(), py::arg("routed_experts_start") = 0,
          py::arg("n") = 1, py::arg("logprobs") = py::none(),
          py::arg("prompt_logprobs") = py::none(), py::arg("stop") = py::none(),
          py::arg("include_stop_str_in_output") = false, py::arg("skip_special_tokens") = true,
          py::arg("routed_experts_prompt_start") = py::none(),
          py::arg("return_routed_expert_weights") = false)
      .def_property(
          "stop", [](const PySamplingParams& s) { return s.p.stop; },
          [](PySamplingParams& s, std::vector<std::string> v) { s.p.stop = std::move(v); })
      .def_property(
          "max_tokens", [](const PySamplingParams& s) { return s.p.max_tokens; },
          [](PySamplingParams& s, int v) { s.p.max_tokens = v; })
      .def_property(
          "temperature", [](const PySamplingParams& s) { return s.p.temperature; },
          [](PySamplingParams& s, float v) { s.p.temperature = v; })
      .def_property(
          "top_p", [](const PySamplingParams& s) { return s.p.top_p; },
          [](PySamplingParams& s, float v) { s.p.top_p = v; })
      .def_property(
          "top_k", [](const PySamplingParams& s) { return s.p.top_k; },
          [](PySamplingParams& s, int v) { s.p.top_k = v; })
      .def_readwrite("seed", &PySamplingParams::seed)
      .def_property(
          "stop_token_ids", [](const PySamplingParams& s) { return s.p.stop_token_ids; },
          [](PySamplingParams& s, std::vector<int> v) { s.p.stop_token_ids = std::move(v); })
      .def_property(
          "ignore_eos", [](const PySamplingParams& s) { return s.p.ignore_eos; },
          [](PySamplingParams& s, bool v) { s.p.ignore_eos = v; })
      .def_readwrite("return_routed_experts", &PySamplingParams::return_routed_experts)
      .def_property(
          "return_routed_expert_weights",
          [](const PySamplingParams& s) { return s.p.return_routed_expert_weights; },
          [](PySamplingParams& s, bool v) { s.p.return_routed_expert_weights = v; })
      .def_property(
          "routed_experts_start",
          [](const PySamplingParams& s) { return s.p.routed_experts_start; },
          [](PySamplingParams& s, int v) { s.p.routed_experts_start = v; })
      .def("__repr__", [](const PySamplingParams& s) {
        return "SamplingParams(max_tokens=" + std::to_string(s.p.max_tokens) +
               ", temperature=" + std::to_string(s.p.temperature) +
               ", top_p=" + std::to_string(s.p.top_p) + ", top_k=" + std::to_string(s.p.top_k) +
               ", seed=" + (s.seed ? std::to_string(*s.seed) : std::string("None")) + ")";
      });

  py::class_<CompletionOutput>(m, "CompletionOutput")
      .def_readonly("index", &CompletionOutput::index)
      .def_readonly("text", &CompletionOutput::text)
      .def_readonly("token_ids", &CompletionOutput::token_ids)
      .def_readonly("logprobs", &CompletionOutput::logprobs)
      .def_readonly("cumulative_logprob", &CompletionOutput::cumulative_logprob)
      .def_readonly("finish_reason", &CompletionOutput::finish_reason)
      .def_readonly("stop_reason", &CompletionOutput::stop_reason)
      .def_readonly("weight_versions", &CompletionOutput::weight_versions)
      .def_readonly("routed_experts", &CompletionOutput::routed_experts)
      .def_readonly("routed_expert_weights", &CompletionOutput::routed_expert_weights)
      .def_readonly("routed_experts_start", &CompletionOutput::routed_experts_start)
      .def_readonly("moe_layers", &CompletionOutput::moe_layers)
      .def_readonly("top_logprobs", &CompletionOutput::top_logprobs);

  py::class_<PyRequestOutput>(m, "RequestOutput")
      .def_readonly("request_id", &PyRequestOutput::request_id)
      .def_readonly("prompt_token_ids", &PyRequestOutput::prompt_token_ids)
      .def_readonly("outputs", &PyRequestOutput::outputs)
      .def_readonly("finished", &PyRequestOutput::finished)
      .def_readonly("num_cached_tokens", &PyRequestOutput::num_cached_tokens)
      .def_readonly("prompt_logprobs", &PyRequestOutput::prompt_logprobs)
      .def_readonly("prompt_routed_experts", &PyRequestOutput::prompt_routed_experts)
      .def_readonly("prompt_routed_expert_weights", &PyRequestOutput::prompt_routed_expert_weights)
      .def_property_readonly("routed_experts", &PyRequestOutput::routed_experts);

  py::class_<PyTokenizer>(m, "Tokenizer")
      .def_static(
          "from_pretrained",
          [](const std::string& dir) { return PyTokenizer{r3::text::Tokenizer::load(dir)}; },
          py::arg("path"))
      .def("encode", &PyTokenizer::encode, py::arg("text"), py::arg("add_special_tokens") = true)
      .def("decode", &PyTokenizer::decode, py::arg("token_ids"),
           py::arg("skip_special_tokens") = false)
      .def("apply_chat_template", &PyTokenizer::apply_chat_template, py::arg("conversation"),
           py::kw_only(), py::arg("tokenize") = true, py::arg("add_generation_prompt") = false,
           py::arg("continue_final_message") = false, py::arg("tools") = py::none(),
           py::arg("chat_template") = py::none())
      .def("convert_ids_to_tokens",
           [](const PyTokenizer& t, std::vector<int32_t> ids) {
             py::list out;
             for (int32_t id : ids) {
               auto tok = t.tok->id_to_token(id);
               out.append(tok ? py::object(py::str(*tok)) : py::object(py::none()));
             }
             return out;
           })
      .def_property_readonly("vocab_size", [](const PyTokenizer& t) { return t.tok->vocab_size(); })
      .def_property_readonly("eos_token_id", [](const PyTokenizer& t) { return t.tok->eos_id(); })
      .def_property_readonly("bos_token_id", [](const PyTokenizer& t) { return t.tok->bos_id(); })
      .def_property_readonly("eos_token", [](const PyTokenizer& t) { return t.tok->eos_token(); })
      .def_property_readonly("bos_token", [](const PyTokenizer& t) { return t.tok->bos_token(); })
      .def_property_readonly("chat_template",
                             [](const PyTokenizer& t) { return t.tok->chat_template(); });

  py::class_<LLM>(m, "LLM")
      .def(py::init<const std::string&, bool, const py::kwargs&>(), py::arg("model"),
           py::arg("enable_return_routed_experts") = false)
      .def("generate", &LLM::generate, py::arg("prompts"), py::arg("sampling_params") = py::none(),
           "Runs every prompt to completion; outputs in input order.")
      .def("update_weights", &LLM::update_weights, py::arg("path"), py::arg("flush_cache") = true,
           "Refit from a checkpoint directory (same architecture and shapes).")
      .def("update_weights_from_tensors", &LLM::update_weights_from_tensors,
           py::arg("named_tensors"), py::arg("flush_cache") = true, py::arg("finished") = true,
           "In-memory refit: {name: array} (or (name, array) pairs) in Hugging Face names; a "
           "subset may be sent "
           "in buckets with finished=False and a last bucket with finished=True (the version goes "
           "up once). "
           "Every tensor's name, shape, dtype and values are checked first; a refused bucket "
           "changes nothing. "
           "Each bucket is packed into the served weights as it arrives (no second copy is held): "
           "until the "
           "last bucket, generating is refused naming the refit under way. Returns the number of "
           "tensors sent "
           "in this refit's buckets so far.")
      .def("chat", &LLM::chat, py::arg("messages"), py::arg("sampling_params") = py::none(),
           py::kw_only(), py::arg("chat_template") = py::none(),
           py::arg("add_generation_prompt") = true, py::arg("continue_final_message") = false,
           py::arg("tools") = py::none(), py::arg("chat_template_kwargs") = py::none())
      .def("get_tokenizer", &LLM::get_tokenizer)
      .def_property_readonly("weight_version", &LLM::weight_version)
      .def("stats", &LLM::stats)
      .def_property_readonly("model_config", &LLM::model_config);

  py::class_<PyStream>(m, "_Stream").def("next", &PyStream::next, py::arg("timeout_s"));
  py::class_<AsyncEngine>(m, "_AsyncEngine")
      .def(py::init<const std::string&, bool, const py::kwargs&>(), py::arg("model"),
           py::arg("enable_return_routed_experts") = false)
      .def("submit", &AsyncEngine::submit, py::arg("prompt"), py::arg("sampling_params"),
           py::arg("request_id"))
      .def("abort", &AsyncEngine::abort, py::arg("request_id"))
      .def("pause_generation", &AsyncEngine::pause_generation, py::arg("mode"))
      .def("continue_generation", &AsyncEngine::continue_generation)
      .def("reset_prefix_cache", &AsyncEngine::reset_prefix_cache)
      .def("sleep", &AsyncEngine::sleep, py::arg("level"))
      .def("wake_up", &AsyncEngine::wake_up, py::arg("tags"))
      .def("update_weights", &AsyncEngine::update_weights, py::arg("path"), py::arg("flush_cache"),
           py::arg("weight_version"))
      .def("update_weights_from_tensors", &AsyncEngine::update_weights_from_tensors,
           py::arg("named_tensors"), py::arg("flush_cache"), py::arg("weight_version"),
           py::arg("finished"))
      .def("get_weight_version", &AsyncEngine::get_weight_version)
      .def("is_paused", &AsyncEngine::is_paused);
}
