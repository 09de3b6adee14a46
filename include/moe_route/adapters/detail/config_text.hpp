// moe_route: the text form of runtime configurations, "field=value;field=value",
// which host frameworks pass through interfaces that carry strings but no
// structs (a PyTorch operator schema, a command line). Fields are those of
// runtime::router_config and runtime::admission_config under the names the
// Python layer uses (docs/python.md); absent fields keep their defaults.
// Numbers are read with std::from_chars, so a float printed with Python's
// repr() (shortest round trip, "inf", "-inf") comes back bit for bit.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <moe_route/presets.hpp>
#include <moe_route/runtime/config.hpp>

namespace moe_route::adapters::detail {

using moe_route::detail::fail;

// The fields of one text, in order; `what` names the configuration in errors.
inline std::vector<std::pair<std::string_view, std::string_view>> fields_of(std::string_view text,
                                                                            std::string_view what) {
  std::vector<std::pair<std::string_view, std::string_view>> fields;
  while (!text.empty()) {
    const std::size_t end = text.find(';');
    const std::string_view item = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      fail(std::string(what) + ": '" + std::string(item) + "' is not field=value");
    fields.emplace_back(item.substr(0, eq), item.substr(eq + 1));
  }
  return fields;
}

template <class T>
T number_of(std::string_view field, std::string_view value) {
  T v{};
  const char* last = value.data() + value.size();
  std::from_chars_result r{};
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars takes no leading '+'; repr() never writes one.
    r = std::from_chars(value.data(), last, v, std::chars_format::general);
  } else {
    r = std::from_chars(value.data(), last, v);
  }
  if (r.ec != std::errc{} || r.ptr != last)
    fail(std::string(field) + " = '" + std::string(value) + "' is not a " +
         (std::is_floating_point_v<T> ? "number" : "whole number in range"));
  return v;
}

inline bool flag_of(std::string_view field, std::string_view value) {
  if (value == "1" || value == "true" || value == "True") return true;
  if (value == "0" || value == "false" || value == "False") return false;
  fail(std::string(field) + " = '" + std::string(value) + "' is not a boolean (1 or 0)");
}

template <class Enum, std::size_t N>
Enum enum_of(std::string_view field, std::string_view value, const std::pair<const char*, Enum> (&names)[N]) {
  std::string all;
  for (const auto& [n, e] : names) {
    if (value == n) return e;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  fail(std::string(field) + " = '" + std::string(value) + "' is not one of: " + all);
}

inline constexpr std::pair<const char*, runtime::gating_kind> gating_names[] = {
    {"softmax", runtime::gating_kind::softmax},
    {"sigmoid", runtime::gating_kind::sigmoid},
    {"sqrt_softplus", runtime::gating_kind::sqrt_softplus},
    {"softmax_after_topk", runtime::gating_kind::softmax_after_topk}};
inline constexpr std::pair<const char*, runtime::selection_kind> selection_names[] = {
    {"top_k", runtime::selection_kind::top_k},
    {"expert_bias", runtime::selection_kind::expert_bias},
    {"group_limited", runtime::selection_kind::group_limited},
    {"group_limited_bias", runtime::selection_kind::group_limited_bias},
    {"group_limited_score", runtime::selection_kind::group_limited_score},
    {"fixed", runtime::selection_kind::fixed}};
inline constexpr std::pair<const char*, runtime::prior_kind> prior_names[] = {
    {"none", runtime::prior_kind::none},
    {"log_prior_bias", runtime::prior_kind::log_prior_bias},
    {"prior_override", runtime::prior_kind::prior_override}};
inline constexpr std::pair<const char*, penalty::load_balance::scope> scope_names[] = {
    {"batch", penalty::load_balance::scope::batch},
    {"sequence", penalty::load_balance::scope::sequence},
    {"global_batch", penalty::load_balance::scope::global_batch}};
inline constexpr std::pair<const char*, penalty::load_balance::count> count_names[] = {
    {"selected", penalty::load_balance::count::selected}, {"top_k", penalty::load_balance::count::top_k}};
inline constexpr std::pair<const char*, penalty::load_balance::length> length_names[] = {
    {"own", penalty::load_balance::length::own}, {"batch_mean", penalty::load_balance::length::batch_mean}};
inline constexpr std::pair<const char*, bool> admission_kind_names[] = {{"dropless", true}, {"capacity", false}};
inline constexpr std::pair<const char*, runtime::affinity_kind> affinity_names[] = {
    {"position", runtime::affinity_kind::position},
    {"probability", runtime::affinity_kind::probability},
    {"logit", runtime::affinity_kind::logit},
    {"cosine", runtime::affinity_kind::cosine},
    {"gate", runtime::affinity_kind::gate}};
inline constexpr std::pair<const char*, runtime::overflow_kind> overflow_names[] = {
    {"drop", runtime::overflow_kind::drop}, {"reroute", runtime::overflow_kind::reroute}};

inline runtime::gating_kind gating_of(std::string_view name) { return enum_of("gating", name, gating_names); }

// A validated router_config. `normalize` absent takes the gating's default.
inline runtime::router_config router_config_of(std::string_view text) {
  runtime::router_config c;
  bool normalize_given = false;
  for (const auto& [key, v] : fields_of(text, "RouterConfig")) {
    if (key == "gating") c.gating = gating_of(v);
    else if (key == "selection") c.selection = enum_of(key, v, selection_names);
    else if (key == "prior") c.prior = enum_of(key, v, prior_names);
    else if (key == "load_balance_scope") c.load_balance.over = enum_of(key, v, scope_names);
    else if (key == "load_balance_counts") c.load_balance.counts = enum_of(key, v, count_names);
    else if (key == "load_balance_sequence_length") c.load_balance.sequence_length = enum_of(key, v, length_names);
    else if (key == "top_k") c.top_k = number_of<int>(key, v);
    else if (key == "normalize") normalize_given = true, c.normalize = flag_of(key, v);
    else if (key == "scaling_factor") c.scaling_factor = number_of<float>(key, v);
    else if (key == "groups") c.groups = number_of<int>(key, v);
    else if (key == "top_groups") c.top_groups = number_of<int>(key, v);
    else if (key == "per_group_k") c.per_group_k = number_of<int>(key, v);
    else if (key == "bias_update_rate") c.bias_update_rate = number_of<float>(key, v);
    else if (key == "prior_beta") c.prior_bias.beta = number_of<float>(key, v);
    else if (key == "bias_gates") c.prior_bias.bias_gates = flag_of(key, v);
    else if (key == "load_balance") c.load_balance.coefficient = number_of<float>(key, v);
    else if (key == "z_loss") c.z_loss.coefficient = number_of<float>(key, v);
    else if (key == "kl_to_base") c.kl_to_base.coefficient = number_of<float>(key, v);
    else if (key == "logit_l2") c.logit_l2.coefficient = number_of<float>(key, v);
    else if (key == "locality") c.locality.coefficient = number_of<float>(key, v);
    else if (key == "locality_epsilon") c.locality.epsilon = number_of<float>(key, v);
    else fail("RouterConfig has no field '" + std::string(key) + "'");
  }
  if (!normalize_given) c.normalize = runtime::normalizes_by_default(c.gating);
  runtime::validate(c);
  return c;
}

// A validated admission_config; the empty text is dropless admission.
inline runtime::admission_config admission_config_of(std::string_view text) {
  runtime::admission_config a;
  for (const auto& [key, v] : fields_of(text, "Admission")) {
    if (key == "kind") a.dropless = enum_of(key, v, admission_kind_names);
    else if (key == "affinity") a.affinity = enum_of(key, v, affinity_names);
    else if (key == "overflow") a.overflow = enum_of(key, v, overflow_names);
    else if (key == "threshold") a.threshold = number_of<float>(key, v);
    else if (key == "capacity_factor") a.capacity_factor = number_of<double>(key, v);
    else if (key == "min_capacity") a.min_capacity = number_of<std::int64_t>(key, v);
    else if (key == "renormalize") a.renormalize = flag_of(key, v);
    else if (key == "fill_factor") a.fill_factor = number_of<double>(key, v);
    else if (key == "max_rounds") a.max_rounds = number_of<int>(key, v);
    else fail("Admission has no field '" + std::string(key) + "'");
  }
  runtime::validate(a);
  return a;
}

// A number in the shortest text that reads back to the same bits.
template <class T>
std::string text_of(T v) {
  char buffer[32];
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof buffer, v);
  return std::string(buffer, r.ptr);
}

template <class Enum, std::size_t N>
const char* name_of(Enum e, const std::pair<const char*, Enum> (&names)[N]) {
  for (const auto& [n, value] : names)
    if (value == e) return n;
  return "?";
}

// The text form of an admission configuration (admission_config_of reads it back).
inline std::string text_of(const runtime::admission_config& a) {
  return std::string("kind=") + name_of(a.dropless, admission_kind_names) + ";affinity=" +
         name_of(a.affinity, affinity_names) + ";overflow=" + name_of(a.overflow, overflow_names) +
         ";threshold=" + text_of(a.threshold) + ";capacity_factor=" + text_of(a.capacity_factor) +
         ";min_capacity=" + std::to_string(a.min_capacity) + ";renormalize=" + (a.renormalize ? "1" : "0") +
         ";fill_factor=" + text_of(a.fill_factor) + ";max_rounds=" + std::to_string(a.max_rounds);
}

// The admission presets (docs/admission.md) by name: each fixes the affinity,
// the overflow and, for the cosine ones, a default threshold (CIPHER: 0,
// LocMoE: 0.01, used when `threshold` is not given; the capacity presets have
// none); the capacity and fill factors are the caller's.
inline runtime::admission_config admission_preset_of(std::string_view name, double capacity_factor,
                                                     double fill_factor, std::optional<float> threshold) {
  runtime::admission_config a;
  if (name == "dropless") return a;
  a.dropless = false;
  a.capacity_factor = capacity_factor;
  a.fill_factor = fill_factor;
  if (name == "cipher_strict" || name == "cipher_reroute" || name == "locmoe") {
    a.affinity = runtime::affinity_kind::cosine;
    a.threshold = threshold.value_or(name == "locmoe" ? 0.01f : 0.0f);
    if (name == "cipher_reroute") a.overflow = runtime::overflow_kind::reroute;
  } else if (name == "capacity_position") {
    a.affinity = runtime::affinity_kind::position;
  } else if (name == "capacity_probs") {
    a.affinity = runtime::affinity_kind::probability;
  } else if (name == "capacity_gate") {
    a.affinity = runtime::affinity_kind::gate;
  } else {
    fail("no admission preset named '" + std::string(name) +
         "' (dropless, cipher_strict, cipher_reroute, locmoe, capacity_position, capacity_probs, capacity_gate)");
  }
  return a;  // checked where it is used (runtime::validate), like any other admission_config
}

// The published models' routers (presets.hpp) as RouterConfig fields in text
// form, and each model's number of routed experts.
struct preset_fields {
  std::string text;
  int num_experts = 0;
};

inline preset_fields preset_of(std::string_view name) {
  namespace p = presets;
  const auto common = [](const auto& r, const char* gating, const char* selection, int experts) {
    return preset_fields{std::string("gating=") + gating + ";selection=" + selection +
                             ";top_k=" + std::to_string(r.top_k) + ";normalize=" + (r.normalize ? "1" : "0") +
                             ";scaling_factor=" + text_of(r.scaling_factor),
                         experts};
  };
  const auto rate = [](float r) { return ";bias_update_rate=" + text_of(r); };
  if (name == "deepseek_v2_lite") return common(p::deepseek_v2_lite(), "softmax", "top_k", p::deepseek_v2_lite_experts);
  if (name == "qwen3") return common(p::qwen3(), "softmax", "top_k", p::qwen3_experts);
  if (name == "mixtral") return common(p::mixtral(), "softmax_after_topk", "top_k", p::mixtral_experts);
  if (name == "moonlight") {
    preset_fields f = common(p::moonlight(), "sigmoid", "expert_bias", p::moonlight_experts);
    f.text += rate(p::moonlight().selection.update_rate);
    return f;
  }
  if (name == "deepseek_v4") {
    preset_fields f = common(p::deepseek_v4(), "sqrt_softplus", "expert_bias", p::deepseek_v4_experts);
    f.text += rate(p::deepseek_v4().selection.update_rate);
    return f;
  }
  if (name == "deepseek_v3") {
    const auto r = p::deepseek_v3();
    preset_fields f = common(r, "sigmoid", "group_limited_bias", p::deepseek_v3_experts);
    f.text += ";groups=" + std::to_string(r.selection.groups) + ";top_groups=" + std::to_string(r.selection.top_groups) +
              ";per_group_k=" + std::to_string(r.selection.per_group_k) + rate(r.selection.inner.update_rate);
    return f;
  }
  fail("no preset named '" + std::string(name) +
       "' (deepseek_v2_lite, moonlight, deepseek_v3, qwen3, mixtral, deepseek_v4)");
}

}  // namespace moe_route::adapters::detail
