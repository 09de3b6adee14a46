// Fuzz target: the text form of the runtime configurations
// (adapters/detail/config_text.hpp), which the Python layer and the drivers
// pass through operator schemas and command lines. The first byte picks the
// parser (RouterConfig, Admission, a preset name), the rest is the text.
// Every text must either be refused with moe_route::error and a message, or
// give a configuration that (a) reads back bit for bit from its own text form
// and (b) routes, or admits, a small batch of the shape it allows without an
// error: a parser that accepts what the backends refuse is a finding too.
#include <moe_route/adapters/detail/config_text.hpp>

#include "fuzz_input.hpp"
#include "runtime_route.hpp"

#include <cstring>
#include <string>
#include <vector>

namespace {

namespace mr = moe_route;
namespace rt = moe_route::runtime;
namespace text = moe_route::adapters::detail;

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// Every field of a router_config in the text form (the parser's names).
std::string text_of(const rt::router_config& c) {
  using text::text_of;
  const auto& lb = c.load_balance;
  return std::string("gating=") + text::name_of(c.gating, text::gating_names) +
         ";selection=" + text::name_of(c.selection, text::selection_names) +
         ";prior=" + text::name_of(c.prior, text::prior_names) + ";top_k=" + std::to_string(c.top_k) +
         ";normalize=" + (c.normalize ? "1" : "0") + ";scaling_factor=" + text_of(c.scaling_factor) +
         ";groups=" + std::to_string(c.groups) + ";top_groups=" + std::to_string(c.top_groups) +
         ";per_group_k=" + std::to_string(c.per_group_k) + ";bias_update_rate=" + text_of(c.bias_update_rate) +
         ";prior_beta=" + text_of(c.prior_bias.beta) + ";bias_gates=" + (c.prior_bias.bias_gates ? "1" : "0") +
         ";load_balance=" + text_of(lb.coefficient) + ";load_balance_scope=" + text::name_of(lb.over, text::scope_names) +
         ";load_balance_counts=" + text::name_of(lb.counts, text::count_names) +
         ";load_balance_sequence_length=" + text::name_of(lb.sequence_length, text::length_names) +
         ";z_loss=" + text_of(c.z_loss.coefficient) + ";kl_to_base=" + text_of(c.kl_to_base.coefficient) +
         ";logit_l2=" + text_of(c.logit_l2.coefficient) + ";locality=" + text_of(c.locality.coefficient) +
         ";locality_epsilon=" + text_of(c.locality.epsilon);
}

bool same(const rt::router_config& a, const rt::router_config& b) {
  return a.gating == b.gating && a.selection == b.selection && a.prior == b.prior && a.top_k == b.top_k &&
         a.normalize == b.normalize && same_bits(a.scaling_factor, b.scaling_factor) && a.groups == b.groups &&
         a.top_groups == b.top_groups && a.per_group_k == b.per_group_k &&
         same_bits(a.bias_update_rate, b.bias_update_rate) && same_bits(a.prior_bias.beta, b.prior_bias.beta) &&
         a.prior_bias.bias_gates == b.prior_bias.bias_gates &&
         same_bits(a.load_balance.coefficient, b.load_balance.coefficient) && a.load_balance.over == b.load_balance.over &&
         a.load_balance.counts == b.load_balance.counts &&
         a.load_balance.sequence_length == b.load_balance.sequence_length &&
         same_bits(a.z_loss.coefficient, b.z_loss.coefficient) &&
         same_bits(a.kl_to_base.coefficient, b.kl_to_base.coefficient) &&
         same_bits(a.logit_l2.coefficient, b.logit_l2.coefficient) &&
         same_bits(a.locality.coefficient, b.locality.coefficient) && same_bits(a.locality.epsilon, b.locality.epsilon);
}

bool same(const rt::admission_config& a, const rt::admission_config& b) {
  return a.dropless == b.dropless && a.affinity == b.affinity && a.overflow == b.overflow &&
         same_bits(a.threshold, b.threshold) && same_bits(a.capacity_factor, b.capacity_factor) &&
         a.min_capacity == b.min_capacity && a.renormalize == b.renormalize &&
         same_bits(a.fill_factor, b.fill_factor) && a.max_rounds == b.max_rounds;
}

// The fewest experts a configuration routes over: K of them, or enough
// groups of enough experts (in 64 bits: the fields are any ints).
std::int64_t experts_for(const rt::router_config& c) {
  if (!rt::selection_is_grouped(c.selection)) return c.top_k;
  const std::int64_t per_kept_group = (c.top_k + c.top_groups - 1) / c.top_groups;
  return std::int64_t{c.groups} * std::max<std::int64_t>(c.per_group_k, per_kept_group);
}

struct batch {
  std::int64_t N = 3;
  int E = 1;
  std::vector<float> logits, bias;
  fuzz::routed routed;
};

// Routes a small batch in evaluation mode (training would need the prior's
// and the penalties' own inputs, which a configuration cannot supply).
batch route(const rt::router_config& c, int E) {
  batch b;
  b.E = E;
  b.logits.resize(static_cast<std::size_t>(b.N) * E);
  for (std::size_t i = 0; i < b.logits.size(); ++i) b.logits[i] = static_cast<float>((i * 7) % 11) - 5.0f;
  b.bias.assign(E, 0.0f);
  b.routed = fuzz::route(c, b.logits, b.N, E, b.bias.data(), 1, mr::mode::eval);
  return b;
}

template <class Parse>
bool parses(Parse parse) {
  try {
    parse();
    return true;
  } catch (const mr::error& e) {
    FUZZ_CHECK(std::strlen(e.what()) > 0, "an error without a message");
    return false;
  }
}

void router(const std::string& t) {
  rt::router_config c;
  if (!parses([&] { c = text::router_config_of(t); })) return;
  const std::string canonical = text_of(c);
  rt::router_config again;
  FUZZ_CHECK(parses([&] { again = text::router_config_of(canonical); }), canonical);
  FUZZ_CHECK(same(c, again), "'" + t + "' and its text form '" + canonical + "' differ");
  const std::int64_t E = experts_for(c);
  if (E <= mr::max_experts) route(c, static_cast<int>(E));  // more is refused by the backend, rightly
}

void admission(const std::string& t) {
  rt::admission_config a;
  if (!parses([&] { a = text::admission_config_of(t); })) return;
  const std::string canonical = text::text_of(a);
  rt::admission_config again;
  FUZZ_CHECK(parses([&] { again = text::admission_config_of(canonical); }), canonical);
  FUZZ_CHECK(same(a, again), "'" + t + "' and its text form '" + canonical + "' differ");
  rt::router_config c;
  c.top_k = 2;
  const batch b = route(c, 4);
  const std::vector<float> norms(static_cast<std::size_t>(b.N) + b.E, 1.0f);
  mr::admission_inputs<float> in;
  in.logits = b.logits.data();
  in.num_tokens = b.N;
  in.num_experts = b.E;
  in.routed_indices = b.routed.indices.data();
  in.routed_gates = b.routed.gates.data();
  in.hidden_norms = norms.data();
  in.weight_norms = norms.data() + b.N;
  std::vector<std::int32_t> indices(b.routed.indices.size());
  std::vector<float> gates(indices.size());
  mr::admission_outputs out;
  out.indices = indices.data();
  out.gates = gates.data();
  rt::admit(c, a, in, out);
}

void preset(const std::string& name) {
  text::preset_fields f;
  if (!parses([&] { f = text::preset_of(name); })) return;
  rt::router_config c;
  FUZZ_CHECK(parses([&] { c = text::router_config_of(f.text); }), "preset " + name + ": " + f.text);
  route(c, f.num_experts);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string t(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: router(t); break;
    case 1: admission(t); break;
    default: preset(t); break;
  }
  return 0;
}
