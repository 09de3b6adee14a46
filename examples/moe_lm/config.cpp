#include "config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "data.hpp"

namespace moe_lm {

namespace {

constexpr std::pair<gating_preset, const char*> preset_names[] = {
    {gating_preset::softmax, "softmax"},
    {gating_preset::sigmoid_bias, "sigmoid_bias"},
    {gating_preset::group_limited, "group_limited"},
    {gating_preset::sqrt_softplus, "sqrt_softplus"},
    {gating_preset::softmax_after_topk, "softmax_after_topk"}};

// A field's name as n names it: top_k, or --top-k.
std::string name_of(const char* field, naming n) {
  std::string s = field;
  if (n == naming::flags) {
    std::replace(s.begin(), s.end(), '_', '-');
    s = "--" + s;
  }
  return s;
}

template <class T>
void check_at_least(const char* field, T value, T least, naming n) {
  if (value < least)
    throw std::invalid_argument(name_of(field, n) + " (= " + std::to_string(value) + ") must be >= " +
                                std::to_string(least));
}

}  // namespace

const char* preset_name(gating_preset p) {
  for (const auto& [preset, name] : preset_names)
    if (preset == p) return name;
  return "?";
}

gating_preset parse_preset(const std::string& name) {
  std::string known;
  for (const auto& [preset, n] : preset_names) {
    if (name == n) return preset;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw std::invalid_argument("unknown gating preset \"" + name + "\" (" + known + ")");
}

double parameter_count(const model_config& c) {
  const double d = static_cast<double>(c.d_model), e = static_cast<double>(c.experts);
  const double norms = c.rms_norm ? d : 2.0 * d;  // RMSNorm: a gain; LayerNorm: a gain and a bias
  const double attention = 4.0 * d * d;           // qkv and the output projection
  const double moe = e * d + 2.0 * e * d * static_cast<double>(c.expert_hidden) +
                     2.0 * d * static_cast<double>(c.shared_hidden);
  const double embeddings = static_cast<double>(vocab::size) * d + static_cast<double>(c.max_len) * d;
  const double head = c.tie_embeddings ? 0.0 : static_cast<double>(vocab::size) * d;
  return embeddings + static_cast<double>(c.layers) * (2.0 * norms + attention + moe) + norms + head;
}

void check(const model_config& c, naming n) {
  check_at_least<std::int64_t>("d_model", c.d_model, 1, n);
  check_at_least<std::int64_t>("layers", c.layers, 1, n);
  check_at_least<std::int64_t>("heads", c.heads, 1, n);
  if (c.d_model % c.heads != 0)
    throw std::invalid_argument(name_of("d_model", n) + " (= " + std::to_string(c.d_model) +
                                ") must be a multiple of " + name_of("heads", n) + " (= " + std::to_string(c.heads) +
                                ")");
  check_at_least<std::int64_t>("experts", c.experts, 1, n);
  if (c.experts > moe_route::max_experts)
    throw std::invalid_argument(name_of("experts", n) + " (= " + std::to_string(c.experts) + ") must be <= " +
                                std::to_string(moe_route::max_experts));
  const std::int64_t max_k = std::min<std::int64_t>(c.experts, rt::router_max_k);
  if (c.top_k < 1 || c.top_k > max_k)
    throw std::invalid_argument(name_of("top_k", n) + " (= " + std::to_string(c.top_k) + ") must be in [1, " +
                                std::to_string(max_k) + "] (at most the experts and " +
                                std::to_string(rt::router_max_k) + ")");
  check_at_least<std::int64_t>("expert_hidden", c.expert_hidden, 1, n);
  check_at_least<std::int64_t>("shared_hidden", c.shared_hidden, 1, n);
  check_at_least<std::int64_t>("max_len", c.max_len, 4, n);
  if (!(std::isfinite(c.bias_update_rate) && c.bias_update_rate >= 0.0f))
    throw std::invalid_argument(name_of("bias_update_rate", n) + " (= " + std::to_string(c.bias_update_rate) +
                                ") must be finite and >= 0");
  const double parameters = parameter_count(c);
  if (parameters > static_cast<double>(max_model_parameters)) {
    char count[32];
    std::snprintf(count, sizeof count, "%.4g", parameters);
    throw std::invalid_argument(std::string("the model would have ") + count + " parameters, more than 2^31 (" +
                                name_of("d_model", n) + ", " +
                                name_of("experts", n) + ", " + name_of("expert_hidden", n) + ", ...)");
  }
}

std::string to_json(const model_config& c) {
  nlohmann::json j{{"d_model", c.d_model},         {"layers", c.layers},
                   {"heads", c.heads},             {"experts", c.experts},
                   {"top_k", c.top_k},             {"expert_hidden", c.expert_hidden},
                   {"shared_hidden", c.shared_hidden}, {"max_len", c.max_len},
                   {"tie_embeddings", c.tie_embeddings}, {"rms_norm", c.rms_norm},
                   {"gating", preset_name(c.gating)}, {"bias_update_rate", c.bias_update_rate}};
  return j.dump();
}

namespace {

template <class T>
T field(const nlohmann::json& j, const char* name) {
  if (!j.contains(name)) throw std::invalid_argument(std::string("no field \"") + name + "\"");
  const nlohmann::json& v = j[name];
  const char* expected = nullptr;
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) expected = "a boolean";
  } else if constexpr (std::is_integral_v<T>) {
    // Integers only, and in T's range (nlohmann's get<> would wrap a larger one).
    if (!v.is_number_integer() ||
        (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<T>::max())
                                : v.get<std::int64_t>() < std::numeric_limits<T>::min() ||
                                      v.get<std::int64_t>() > std::numeric_limits<T>::max()))
      expected = "an integer in range";
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) expected = "a number";
  } else {
    if (!v.is_string()) expected = "a string";
  }
  if (expected) throw std::invalid_argument(std::string("field \"") + name + "\" must be " + expected + ", got " + v.dump());
  return v.get<T>();
}

}  // namespace

model_config model_config_from_json(const std::string& s) {
  try {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(s);
    } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers past double's range
      throw std::invalid_argument(std::string("not JSON (") + e.what() + ")");
    }
    if (!j.is_object()) throw std::invalid_argument("not a JSON object");
    model_config c;
    c.d_model = field<std::int64_t>(j, "d_model");
    c.layers = field<std::int64_t>(j, "layers");
    c.heads = field<std::int64_t>(j, "heads");
    c.experts = field<std::int64_t>(j, "experts");
    c.top_k = field<int>(j, "top_k");
    c.expert_hidden = field<std::int64_t>(j, "expert_hidden");
    c.shared_hidden = field<std::int64_t>(j, "shared_hidden");
    c.max_len = field<std::int64_t>(j, "max_len");
    c.tie_embeddings = field<bool>(j, "tie_embeddings");
    c.rms_norm = field<bool>(j, "rms_norm");
    c.gating = parse_preset(field<std::string>(j, "gating"));
    c.bias_update_rate = field<float>(j, "bias_update_rate");
    check(c, naming::fields);
    return c;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("checkpoint config: ") + e.what());
  }
}

rt::router_config preset_router(const model_config& c) {
  rt::router_config r;
  r.top_k = c.top_k;
  r.bias_update_rate = c.bias_update_rate;
  switch (c.gating) {
    case gating_preset::softmax:
      r.gating = rt::gating_kind::softmax;
      r.selection = rt::selection_kind::top_k;
      r.normalize = false;
      break;
    case gating_preset::sigmoid_bias:
      r.gating = rt::gating_kind::sigmoid;
      r.selection = rt::selection_kind::expert_bias;
      r.normalize = true;
      break;
    case gating_preset::group_limited:
      r.gating = rt::gating_kind::sigmoid;
      r.selection = rt::selection_kind::group_limited_bias;
      // 4 groups when E allows (E = 16: 4 experts each), the best 2 kept.
      r.groups = c.experts % 4 == 0 ? 4 : 1;
      r.top_groups = std::min(2, r.groups);
      r.per_group_k = static_cast<int>(std::min<std::int64_t>(2, c.experts / r.groups));
      r.normalize = true;
      break;
    case gating_preset::sqrt_softplus:
      r.gating = rt::gating_kind::sqrt_softplus;
      r.selection = rt::selection_kind::expert_bias;
      r.normalize = true;
      break;
    case gating_preset::softmax_after_topk:
      r.gating = rt::gating_kind::softmax_after_topk;
      r.selection = rt::selection_kind::top_k;
      break;
  }
  return r;
}

const char* detector_name(community_detector d) { return d == community_detector::louvain ? "louvain" : "leiden"; }

community_detector parse_detector(const std::string& name) {
  for (community_detector d : {community_detector::louvain, community_detector::leiden})
    if (name == detector_name(d)) return d;
  throw std::invalid_argument("unknown community detector \"" + name + "\" (louvain, leiden)");
}

const char* prior_form_name(prior_form f) { return f == prior_form::softmax ? "softmax" : "gate_scores"; }

prior_form parse_prior_form(const std::string& name) {
  if (name == "softmax") return prior_form::softmax;
  if (name == "gate_scores") return prior_form::gate_scores;
  throw std::invalid_argument("unknown prior form \"" + name + "\" (softmax, gate_scores)");
}

}  // namespace moe_lm
