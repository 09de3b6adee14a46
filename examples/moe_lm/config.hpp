// moe_lm: the driver's settings without LibTorch: the architecture (saved with
// the weights), the router presets, the optimiser's schedule, the retention
// measurement and the prior's form, with their names and their checks. The
// command line (options.hpp), the checkpoint reader and the fuzz targets use
// them without building a model.
#pragma once

#include <cstdint>
#include <string>

#include <moe_route/runtime/config.hpp>

namespace moe_lm {

namespace rt = moe_route::runtime;

// The router presets of the base models, after the library's presets
// (moe_route/presets.hpp) at this model's E and K.
enum class gating_preset {
  softmax,             // DeepSeek-V2-Lite: softmax scores, greedy top-k, gates not renormalised
  sigmoid_bias,        // Moonlight: sigmoid scores, top-k of s + b (aux-loss-free bias), gates renormalised
  group_limited,       // DeepSeek-V3: sigmoid_bias within group-limited top-k (4 groups when 4 divides E,
                       // the best 2 kept, a group scored by its 2 best s + b)
  sqrt_softplus,       // DeepSeek-V4: sqrt(softplus) scores, top-k of s + b, gates renormalised
  softmax_after_topk,  // Mixtral: top-k of the logits, softmax over the K selected
};
const char* preset_name(gating_preset p);
// Throws std::invalid_argument naming the known presets.
gating_preset parse_preset(const std::string& name);

// The architecture; saved with the weights.
struct model_config {
  std::int64_t d_model = 64;
  std::int64_t layers = 2;
  std::int64_t heads = 4;
  // E = 64, K = 6: Moonlight's and DeepSeek-V2-Lite's routed geometry (the RPB paper's). At E = 16,
  // K = 2 the co-activation graph has 120 pairs and rho = 0.1 keeps a dozen edges, so most experts are
  // isolated singleton communities and NMI cannot separate methods.
  std::int64_t experts = 64;
  int top_k = 6;
  std::int64_t expert_hidden = 16;   // per routed expert: fine-grained, K x hidden = 96
  std::int64_t shared_hidden = 128;  // the shared expert
  std::int64_t max_len = 48;         // positions
  bool tie_embeddings = true;
  bool rms_norm = true;  // RMSNorm, else LayerNorm
  gating_preset gating = gating_preset::softmax;
  float bias_update_rate = 1e-3f;  // sigmoid_bias: the expert-bias step
};

// The largest model the driver builds: its parameters (embeddings, attention,
// routers, routed and shared experts) fit in 2^31 floats.
inline constexpr std::int64_t max_model_parameters = std::int64_t{1} << 31;

// The number of parameters of c, exact up to 2^53 (a double, so that any
// dimensions give a number to compare); c's dimensions must be positive.
double parameter_count(const model_config& c);

// How a check names a setting: as the command line's flag (--top-k) or as the
// checkpoint's field (top_k).
enum class naming { flags, fields };

// Throws std::invalid_argument naming the first setting out of range: every
// dimension >= 1, heads dividing d_model, experts at most
// moe_route::max_experts, top_k in [1, min(experts, rt::router_max_k)], max_len
// >= 4 (BOS, one prompt byte, SEP, EOS), a finite bias_update_rate >= 0, and at
// most max_model_parameters parameters.
void check(const model_config& c, naming n);

// The checkpoint's form of c, and back: model_config_from_json throws
// std::invalid_argument "checkpoint config: ..." for text that is not a JSON
// object, a missing field, a field of the wrong type, an unknown preset, or a
// configuration check() refuses.
std::string to_json(const model_config& c);
model_config model_config_from_json(const std::string& s);

// The plain router of a preset (no prior, every penalty off).
rt::router_config preset_router(const model_config& c);

// The optimiser and its schedule: what the command line sets of
// train_options (train.hpp).
struct train_settings {
  int steps = 200;
  int batch_size = 32;
  double lr = 3e-3;          // peak learning rate
  int warmup = -1;           // linear warm-up steps (< 0: min(100, steps / 10))
  double final_lr_ratio = 0.1;  // cosine decay from lr to lr * final_lr_ratio after the warm-up
  double clip = 1.0;  // global gradient-norm clip (0: none)
  double beta2 = 0.95;        // AdamW's second-moment decay (RPB App. F: beta = (0.9, 0.95))
  double weight_decay = 0.1;  // AdamW's decoupled decay, on the weight matrices only (not norm gains)
  std::uint64_t seed = 0;
  int admission_groups = 1;
  bool prompt_loss = false;  // also predict the prompt bytes (language-model pretraining), not only the answer
};

enum class community_detector { louvain, leiden };
const char* detector_name(community_detector d);
// Throws std::invalid_argument naming the known detectors.
community_detector parse_detector(const std::string& name);

struct retention_settings {
  double rho = 0.10;  // kept edge fraction of the co-activation graph
  int nulls = 100;    // null-model resamples per layer (RPB Table 9)
  // Detector and null-model seed. Fixed, as in RPB (seed 0), not the
  // training seed: the detector's own seed spread is as large as the
  // training seeds', and tying the two confounds them.
  std::uint64_t seed = 0;
  community_detector detector = community_detector::louvain;
};

// How the prior turns a token's router logits into a distribution over
// experts: the softmax, on every preset (RPB builds its prior from the
// softmaxed router probabilities, whatever the gate), or the preset's own
// gate scores normalised to sum 1 (s / sum s on the sigmoid presets).
enum class prior_form { softmax, gate_scores };
const char* prior_form_name(prior_form f);
// Throws std::invalid_argument naming the known forms.
prior_form parse_prior_form(const std::string& name);

}  // namespace moe_lm
