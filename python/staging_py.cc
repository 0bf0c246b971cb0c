// r3.staging's native half: the C++ staging (src/staging), route wire formats (src/routes) and
// alignment metrics over numpy arrays. Routes go in as any integer array [rows, layers, K] and
// come out as int32 arrays; the Python wrapper (python/r3/staging.py) documents the API.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>

#include "core/error.h"
#include "routes/route_array.h"
#include "routes/route_envelope.h"
#include "routes/route_formats.h"
#include "staging/alignment.h"
#include "staging/staging.h"

namespace py = pybind11;

namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

r3::RouteArray to_routes(const py::handle& a, int start, const char* what) {
  IntArray arr = IntArray::ensure(a);
  if (!arr) throw r3::Error(std::string(what) + ": expected an integer array [rows, layers, K]");
  if (arr.ndim() != 3)
    throw r3::Error(std::string(what) + ": expected 3 dimensions [rows, layers, K], got " +
                    std::to_string(arr.ndim()));
  r3::RouteArray r(int(arr.shape(0)), int(arr.shape(1)), int(arr.shape(2)));
  r.start = start;
  const int64_t* p = arr.data();
  for (size_t i = 0; i < r.data.size(); ++i) {
    if (p[i] < -1 || p[i] > std::numeric_limits<int16_t>::max())
      throw r3::Error(std::string(what) + ": expert id " + std::to_string(p[i]) +
                      " is outside [-1, 32767]");
    r.data[i] = int16_t(p[i]);
  }
  return r;
}

py::array_t<int32_t> to_numpy(const r3::RouteArray& r) {
  py::array_t<int32_t> a({py::ssize_t(r.rows), py::ssize_t(r.layers), py::ssize_t(r.k)});
  int32_t* p = a.mutable_data();
  for (size_t i = 0; i < r.data.size(); ++i) p[i] = r.data[i];
  return a;
}

r3::StagePolicy parse_policy(const std::string& s) {
  if (s == "strict") return r3::StagePolicy::Strict;
  if (s == "lenient") return r3::StagePolicy::Lenient;
  throw r3::Error("policy \"" + s + "\" is not one of strict, lenient");
}

// A staged call keeps its engine reply, which assemble_rollout needs for boundary repair.
struct PyStagedCall {
  r3::StagedCall call;
  r3::RouteArray reply;
};

}  // namespace

void bind_staging(py::module_& m) {
  py::class_<PyStagedCall>(m, "StagedCall")
      .def_property_readonly("rows", [](const PyStagedCall& c) { return to_numpy(c.call.rows); })
      .def_property_readonly("prev_len", [](const PyStagedCall& c) { return c.call.prev_len; })
      .def_property_readonly("total_len", [](const PyStagedCall& c) { return c.call.total_len; })
      .def_property_readonly("filler_rows",
                             [](const PyStagedCall& c) { return c.call.filler_rows; })
      .def_property_readonly("ok", [](const PyStagedCall& c) { return c.call.ok; })
      .def_property_readonly("reply_well_formed",
                             [](const PyStagedCall& c) { return c.call.reply_well_formed; })
      .def_property_readonly("warning", [](const PyStagedCall& c) { return c.call.warning; })
      .def_property_readonly("bad_rows", [](const PyStagedCall& c) { return c.call.bad_rows; })
      .def_property_readonly("call_index", [](const PyStagedCall& c) { return c.call.call_index; })
      .def_property_readonly("versions", [](const PyStagedCall& c) { return c.call.versions; });

  m.def(
      "stage_call",
      [](const py::object& routes, int prev_len, int total_len, int num_experts, int start,
         const std::string& filler, const std::string& policy, int call_index,
         const std::vector<uint64_t>& weight_versions) {
        PyStagedCall c;
        c.reply =
            routes.is_none() ? r3::RouteArray() : to_routes(routes, start, "stage_call: routes");
        c.reply.start = start;
        c.call = r3::stage_call(c.reply, prev_len, total_len, r3::parse_filler(filler),
                                parse_policy(policy), num_experts, call_index);
        c.call.versions = r3::row_versions(weight_versions, prev_len, total_len);
        return c;
      },
      py::arg("routes"), py::arg("prev_len"), py::arg("total_len"), py::arg("num_experts"),
      py::kw_only(), py::arg("start") = 0, py::arg("filler") = "minus_one",
      py::arg("policy") = "strict", py::arg("call_index") = 0,
      py::arg("weight_versions") = std::vector<uint64_t>{});

  m.def(
      "assemble_rollout",
      [](const std::vector<PyStagedCall>& calls, bool repair_boundaries,
         const std::string& version_policy) {
        std::vector<r3::StagedCall> staged;
        std::vector<r3::RouteArray> replies;
        for (const PyStagedCall& c : calls) {
          staged.push_back(c.call);
          replies.push_back(c.reply);
        }
        r3::AssembleReport rep;
        const r3::RouteArray all = r3::assemble_rollout(staged, replies, repair_boundaries, &rep,
                                                        r3::parse_version_policy(version_policy));
        py::dict report;
        report["repaired_boundary_rows"] = rep.repaired_boundary_rows;
        report["filler_rows"] = rep.filler_rows;
        report["versions"] = rep.versions;
        report["mixed_versions"] = rep.mixed_versions;
        report["version_dropped_calls"] = rep.version_dropped_calls;
        return py::make_tuple(to_numpy(all), report);
      },
      py::arg("calls"), py::arg("repair_boundaries") = true, py::arg("version_policy") = "keep");

  m.def("decode_sglang",
        [](const std::string& b64, int num_hidden_layers, int k, std::vector<int> moe_layers) {
          return to_numpy(r3::decode_sglang_routes(b64, num_hidden_layers, k, moe_layers, 0));
        });
  m.def("encode_sglang",
        [](const py::object& routes, std::vector<int> moe_layers, int num_hidden_layers) {
          r3::RouteArray r = to_routes(routes, 0, "encode: routes");
          r.moe_layers = std::move(moe_layers);
          return r3::encode_sglang_routes(r, num_hidden_layers);
        });
  m.def("decode_vllm", [](const std::string& b64) {
    const std::vector<uint8_t> bytes = r3::base64_decode(b64);
    return to_numpy(r3::parse_npy(std::string(bytes.begin(), bytes.end()), "<vllm routes>"));
  });
  m.def("encode_vllm", [](const py::object& routes) {
    return r3::npy_base64(to_routes(routes, 0, "encode: routes"));
  });
  m.def("decode_r3", [](const std::string& transport_json) {
    const r3::RouteArray r = r3::routes_from_json(nlohmann::json::parse(transport_json));
    return py::make_tuple(to_numpy(r), r.start, r.moe_layers);
  });
  m.def("encode_r3", [](const py::object& routes, int start, std::vector<int> moe_layers) {
    r3::RouteArray r = to_routes(routes, start, "encode: routes");
    r.moe_layers = std::move(moe_layers);
    return r3::routes_to_json(r).dump();
  });
  m.def("decode_nrlre1", [](const std::string& s) {
    const r3::EnvelopeIds e = r3::decode_envelope_ids(s);
    py::array_t<int32_t> a({py::ssize_t(e.s), py::ssize_t(e.l), py::ssize_t(e.k)});
    std::memcpy(a.mutable_data(), e.data.data(), e.data.size() * sizeof(int32_t));
    return a;
  });
  m.def("encode_nrlre1", [](const py::object& routes) {
    IntArray arr = IntArray::ensure(routes);
    if (!arr || arr.ndim() != 3)
      throw r3::Error("encode: routes must be an integer array [rows, layers, K]");
    std::vector<int32_t> ids(size_t(arr.size()));
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t v = arr.data()[i];
      if (v < -1 || v > std::numeric_limits<int32_t>::max())
        throw r3::Error("encode: expert id " + std::to_string(v) + " out of range");
      ids[i] = int32_t(v);
    }
    return r3::encode_envelope(ids, int(arr.shape(0)), int(arr.shape(1)), int(arr.shape(2)));
  });

  m.def(
      "alignment_metrics",
      [](const py::object& engine_routes, const py::object& trainer_routes,
         std::vector<float> engine_logprobs, std::vector<float> trainer_logprobs,
         double extreme_threshold) {
        const r3::AlignmentMetrics a =
            r3::compute_alignment(to_routes(engine_routes, 0, "engine_routes"),
                                  to_routes(trainer_routes, 0, "trainer_routes"), engine_logprobs,
                                  trainer_logprobs, extreme_threshold);
        py::dict d;
        d["tokens"] = a.tokens;
        d["router_disagreement_pairs"] = a.router_disagreement_pairs;
        d["router_disagreement_tokens"] = a.router_disagreement_tokens;
        d["mean_differing_layers"] = a.mean_differing_layers;
        d["k3_kl"] = a.k3_kl;
        d["extreme_token_fraction"] = a.extreme_token_fraction;
        d["mean_abs_dlogprob"] = a.mean_abs_dlogprob;
        d["max_abs_dlogprob"] = a.max_abs_dlogprob;
        d["router_tokens"] = a.router_tokens;
        d["skipped_route_rows"] = a.skipped_route_rows;
        return d;
      },
      py::arg("engine_routes"), py::arg("trainer_routes"), py::arg("engine_logprobs"),
      py::arg("trainer_logprobs"), py::arg("extreme_threshold") = 2.0);
}
