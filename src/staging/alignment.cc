#include "staging/alignment.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace r3 {

namespace {

bool row_has_minus_one(const RouteArray& r, int row) {
  const int16_t* p = r.row(row);
  const size_t n = size_t(r.layers) * size_t(r.k);
  for (size_t i = 0; i < n; ++i)
    if (p[i] == -1) return true;
  return false;
}

// Expert sets of one (row, layer) equal? Order and repeats do not matter.
bool same_set(const int16_t* a, const int16_t* b, int k) {
  std::vector<int16_t> x(a, a + k), y(b, b + k);
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  x.erase(std::unique(x.begin(), x.end()), x.end());
  y.erase(std::unique(y.begin(), y.end()), y.end());
  return x == y;
}

}  // namespace

AlignmentMetrics compute_alignment(const RouteArray& engine, const RouteArray& trainer,
                                   const std::vector<float>& engine_logprobs,
                                   const std::vector<float>& trainer_logprobs,
                                   double extreme_threshold) {
  auto shape = [](const RouteArray& r) {
    std::ostringstream o;
    o << "[" << r.rows << ", " << r.layers << ", " << r.k << "]";
    return o.str();
  };
  if (engine.rows != trainer.rows || engine.layers != trainer.layers || engine.k != trainer.k)
    throw Error("compute_alignment: engine routes " + shape(engine) + " and trainer routes " +
                shape(trainer) + " differ in shape");
  if (engine.data.size() != size_t(engine.rows) * engine.layers * engine.k ||
      trainer.data.size() != size_t(trainer.rows) * trainer.layers * trainer.k)
    throw Error("compute_alignment: route data does not match its shape " + shape(engine));
  if (engine_logprobs.size() != trainer_logprobs.size())
    throw Error("compute_alignment: " + std::to_string(engine_logprobs.size()) +
                " engine logprobs but " + std::to_string(trainer_logprobs.size()) +
                " trainer logprobs");
  const int T = int(engine_logprobs.size());
  if (engine.rows != T)
    throw Error("compute_alignment: routes have " + std::to_string(engine.rows) +
                " rows but there are " + std::to_string(T) +
                " logprobs; expected one row per token");
  if (!(extreme_threshold >= 1.0)) throw Error("compute_alignment: extreme_threshold must be >= 1");

  AlignmentMetrics m;
  m.tokens = T;

  // Router metrics.
  const int L = engine.layers, K = engine.k;
  long long differing_pairs = 0, differing_tokens = 0;
  for (int t = 0; t < T; ++t) {
    if (row_has_minus_one(engine, t) || row_has_minus_one(trainer, t)) {
      ++m.skipped_route_rows;
      continue;
    }
    ++m.router_tokens;
    int diff = 0;
    for (int l = 0; l < L; ++l)
      if (!same_set(engine.row(t) + size_t(l) * K, trainer.row(t) + size_t(l) * K, K)) ++diff;
    differing_pairs += diff;
    differing_tokens += (diff > 0);
  }
  if (m.router_tokens > 0) {
    m.mean_differing_layers = double(differing_pairs) / m.router_tokens;
    m.router_disagreement_tokens = double(differing_tokens) / m.router_tokens;
    m.router_disagreement_pairs =
        L > 0 ? double(differing_pairs) / (double(m.router_tokens) * L) : 0.0;
  }

  // Logprob metrics over all T.
  double k3 = 0, abs_sum = 0, abs_max = 0;
  long long extreme = 0;
  for (int t = 0; t < T; ++t) {
    const double li = engine_logprobs[t], lt = trainer_logprobs[t];
    if (!std::isfinite(li) || !std::isfinite(lt))
      throw Error("compute_alignment: logprob of token " + std::to_string(t) + " is not finite");
    const double d = lt - li;  // log r
    const double r = std::exp(d);
    k3 += r - 1.0 - d;
    if (std::max(r, 1.0 / r) > extreme_threshold) ++extreme;
    abs_sum += std::abs(d);
    abs_max = std::max(abs_max, std::abs(d));
  }
  if (T > 0) {
    m.k3_kl = k3 / T;
    m.extreme_token_fraction = double(extreme) / T;
    m.mean_abs_dlogprob = abs_sum / T;
    m.max_abs_dlogprob = abs_max;
  }
  return m;
}

nlohmann::json to_json(const AlignmentMetrics& m) {
  return nlohmann::json{{"tokens", m.tokens},
                        {"router_disagreement_pairs", m.router_disagreement_pairs},
                        {"router_disagreement_tokens", m.router_disagreement_tokens},
                        {"mean_differing_layers", m.mean_differing_layers},
                        {"k3_kl", m.k3_kl},
                        {"extreme_token_fraction", m.extreme_token_fraction},
                        {"mean_abs_dlogprob", m.mean_abs_dlogprob},
                        {"max_abs_dlogprob", m.max_abs_dlogprob}};
}

std::vector<double> abs_dlogprobs(const std::vector<float>& engine_logprobs,
                                  const std::vector<float>& trainer_logprobs) {
  if (engine_logprobs.size() != trainer_logprobs.size())
    throw Error("abs_dlogprobs: " + std::to_string(engine_logprobs.size()) +
                " engine logprobs but " + std::to_string(trainer_logprobs.size()) +
                " trainer logprobs");
  std::vector<double> out(engine_logprobs.size());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = std::abs(double(trainer_logprobs[i]) - double(engine_logprobs[i]));
  return out;
}

// ---------------------------------------------------------------------------------------------
// SVG histogram
// ---------------------------------------------------------------------------------------------

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

std::string dlogprob_histogram_svg(const std::vector<double>& without_replay,
                                   const std::vector<double>& with_replay) {
  constexpr int W = 760, H = 460, ML = 80, MR = 24, MT = 68, MB = 72;
  constexpr int kBinsPerDecade = 4, kMaxDecades = 12;
  const int pw = W - ML - MR, ph = H - MT - MB;
  const char* colors[2] = {"#d62728", "#1f77b4"};
  const char* names[2] = {"without replay", "with replay"};

  std::vector<double> series[2];
  for (int s = 0; s < 2; ++s)
    for (double v : (s == 0 ? without_replay : with_replay))
      if (std::isfinite(v)) series[s].push_back(std::abs(v));

  double min_pos = 0, max_v = 0;
  for (const auto& vs : series)
    for (double v : vs) {
      if (v > 0 && (min_pos == 0 || v < min_pos)) min_pos = v;
      max_v = std::max(max_v, v);
    }
  int lo_exp = -6, hi_exp = 0;  // decades shown when there is no positive value
  if (min_pos > 0) {
    lo_exp = int(std::floor(std::log10(min_pos)));
    hi_exp = int(std::ceil(std::log10(max_v)));
    if (hi_exp <= lo_exp) hi_exp = lo_exp + 1;
    if (hi_exp - lo_exp > kMaxDecades) lo_exp = hi_exp - kMaxDecades;
  }
  const int nb = (hi_exp - lo_exp) * kBinsPerDecade;  // log bins; plus bin "-1" for below 10^lo
  // counts[s][0] = below 10^lo_exp (zeros included); counts[s][1 + b] = log bin b.
  std::vector<double> frac[2];
  double mean[2] = {0, 0};
  for (int s = 0; s < 2; ++s) {
    std::vector<long long> c(size_t(nb) + 1, 0);
    for (double v : series[s]) {
      mean[s] += v;
      if (v < std::pow(10.0, lo_exp)) {
        ++c[0];
        continue;
      }
      int b = int(std::floor((std::log10(v) - lo_exp) * kBinsPerDecade));
      b = std::clamp(b, 0, nb - 1);
      ++c[size_t(b) + 1];
    }
    if (!series[s].empty()) mean[s] /= double(series[s].size());
    frac[s].resize(c.size(), 0.0);
    for (size_t i = 0; i < c.size(); ++i)
      frac[s][i] = series[s].empty() ? 0.0 : double(c[i]) / double(series[s].size());
  }
  double ymax = 0;
  for (const auto& f : frac[0]) ymax = std::max(ymax, f);
  for (const auto& f : frac[1]) ymax = std::max(ymax, f);
  // A "nice" top: the next of 0.1, 0.2, 0.25, 0.5, 1.0 (fractions never exceed 1).
  double ytop = 1.0;
  for (double cand : {0.05, 0.1, 0.2, 0.25, 0.4, 0.5, 0.6, 0.8, 1.0})
    if (ymax <= cand) {
      ytop = cand;
      break;
    }

  // x layout: the underflow bin, a gap of half a bin, then nb log bins.
  const double slot = double(pw) / (nb + 1.5);
  auto bin_x = [&](int i) {
    return i == 0 ? double(ML) : ML + slot * (i + 0.5);
  };  // i: 0 = underflow
  auto y_of = [&](double f) { return MT + ph * (1.0 - f / ytop); };

  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect width=\"" << W << "\" height=\"" << H << "\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
    << "|\xCE\x94 logprob| per sampled token, engine vs trainer</text>\n";
  // Grid and y ticks.
  for (int i = 0; i <= 5; ++i) {
    const double f = ytop * i / 5.0, y = y_of(f);
    o << "<line x1=\"" << ML << "\" y1=\"" << fmt("%.2f", y) << "\" x2=\"" << ML + pw << "\" y2=\""
      << fmt("%.2f", y) << "\" stroke=\"#e0e0e0\"/>\n";
    o << "<text x=\"" << ML - 6 << "\" y=\"" << fmt("%.2f", y + 4) << "\" text-anchor=\"end\">"
      << fmt("%.3g", f) << "</text>\n";
  }
  // Bars, overlaid, semi-transparent.
  for (int s = 0; s < 2; ++s) {
    o << "<g fill=\"" << colors[s] << "\" fill-opacity=\"0.45\" stroke=\"" << colors[s]
      << "\" stroke-width=\"1\">\n";
    for (size_t i = 0; i < frac[s].size(); ++i) {
      if (frac[s][i] <= 0) continue;
      const double x = bin_x(int(i)), y = y_of(frac[s][i]);
      o << "<rect x=\"" << fmt("%.2f", x) << "\" y=\"" << fmt("%.2f", y) << "\" width=\""
        << fmt("%.2f", slot) << "\" height=\"" << fmt("%.2f", MT + ph - y) << "\"/>\n";
    }
    o << "</g>\n";
  }
  // Axes.
  o << "<line x1=\"" << ML << "\" y1=\"" << MT + ph << "\" x2=\"" << ML + pw << "\" y2=\""
    << MT + ph << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << ML << "\" y1=\"" << MT << "\" x2=\"" << ML << "\" y2=\"" << MT + ph
    << "\" stroke=\"black\"/>\n";
  // x ticks: the underflow bin, then every decade boundary.
  o << "<text x=\"" << fmt("%.2f", bin_x(0) + slot / 2) << "\" y=\"" << MT + ph + 16
    << "\" text-anchor=\"middle\">&lt;1e" << lo_exp << "</text>\n";
  for (int d = 0; d <= hi_exp - lo_exp; ++d) {
    const double x = bin_x(1 + d * kBinsPerDecade);
    o << "<line x1=\"" << fmt("%.2f", x) << "\" y1=\"" << MT + ph << "\" x2=\"" << fmt("%.2f", x)
      << "\" y2=\"" << MT + ph + 5 << "\" stroke=\"black\"/>\n";
    o << "<text x=\"" << fmt("%.2f", x) << "\" y=\"" << MT + ph + 18
      << "\" text-anchor=\"middle\">1e" << lo_exp + d << "</text>\n";
  }
  // Axis labels.
  o << "<text x=\"" << ML + pw / 2 << "\" y=\"" << H - 18 << "\" text-anchor=\"middle\">"
    << "|\xCE\x94 logprob| = |log \xCF\x80_train \xE2\x88\x92 log \xCF\x80_infer| (log-scaled "
       "bins, "
    << kBinsPerDecade << " per decade)</text>\n";
  o << "<text x=\"18\" y=\"" << MT + ph / 2
    << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 " << MT + ph / 2
    << ")\">fraction of tokens</text>\n";
  // Legend: one row between the title and the plot, so it never hides a bar.
  const int ly = 36;
  for (int s = 0; s < 2; ++s) {
    const int x = ML + s * (pw / 2);
    o << "<rect x=\"" << x << "\" y=\"" << ly << "\" width=\"14\" height=\"12\" fill=\""
      << colors[s] << "\" fill-opacity=\"0.45\" stroke=\"" << colors[s] << "\"/>\n";
    o << "<text x=\"" << x + 20 << "\" y=\"" << ly + 11 << "\">" << names[s]
      << " (n=" << series[s].size() << ", mean " << fmt("%.3g", mean[s]) << ")</text>\n";
  }
  if (series[0].empty() && series[1].empty())
    o << "<text x=\"" << ML + pw / 2 << "\" y=\"" << MT + ph / 2
      << "\" text-anchor=\"middle\">no data</text>\n";
  o << "</svg>\n";
  return o.str();
}

}  // namespace r3
