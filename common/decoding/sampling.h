#ifndef SPECSERVE_COMMON_DECODING_SAMPLING_H_
#define SPECSERVE_COMMON_DECODING_SAMPLING_H_

#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace specserve {

/// Per-request sampling options (the OpenAI/vLLM knobs). Verification builds
/// the target's p from all of them; the draft builds its q from the same
/// temperature / top-k / top-p (the closer q is to p, the more drafts are
/// accepted) and sends q with its drafts, so any q keeps speculative
/// decoding lossless.
class JsonSchema;  // json_schema.h

struct SamplingParams {
  float temperature = 0.f;  ///< 0 = greedy; otherwise finite and > 0.
  int top_k = 0;            ///< 0 = off; otherwise keep the k most likely.
  float top_p = 1.f;        ///< nucleus mass in (0, 1]; 1 = off.
  uint64_t seed = 0;        ///< seeds the request's Rng.
  // Logit adjustments applied before everything above, in vLLM's order
  // (logits_processors.h): the logit bias, then penalties on tokens already
  // seen (OpenAI's presence / frequency, HF's and vLLM's repetition). They
  // change the target's distribution p; the speculator applies them to its
  // q too, which only raises acceptance.
  float presence_penalty = 0.f;    ///< [-2, 2]; 0 = off.
  float frequency_penalty = 0.f;   ///< [-2, 2]; 0 = off.
  float repetition_penalty = 1.f;  ///< > 0; 1 = off.
  /// OpenAI's logit_bias: (token id, bias added to its logit), ids
  /// ascending, each once; bias in [-100, 100]. Empty = off.
  std::vector<std::pair<int, float>> logit_bias;
  /// vLLM's / llama.cpp's min_p in [0, 1] (0 = off): after temperature,
  /// only tokens whose probability is at least min_p times the likeliest
  /// one's stay; then top-k and top-p (ComputeDistribution, and the CUDA
  /// SampleRows kernel). No effect when greedy.
  float min_p = 0.f;
  /// Structured output, JSON mode (OpenAI's response_format json_object):
  /// the output is one JSON object, then EOS (json_grammar.h). The target
  /// masks every row to the ids that keep it so; the speculator's drafts
  /// follow the same mask.
  bool json_object = false;
  /// With json_object: the schema the object is an instance of (OpenAI's
  /// json_schema; JsonSchema::Compile); null = any object.
  std::shared_ptr<const JsonSchema> json_schema;

  bool greedy() const { return temperature == 0.f; }
  /// Whether any penalty is on.
  bool has_penalties() const {
    return presence_penalty != 0.f || frequency_penalty != 0.f ||
           repetition_penalty != 1.f;
  }
  /// Whether the logits are adjusted before the sampling transform (a bias
  /// or penalties: decided on the host).
  bool adjusts_logits() const {
    return has_penalties() || !logit_bias.empty();
  }
};

/// Most logit_bias entries a request may carry.
inline constexpr int kMaxLogitBias = 1024;

/// OK, or INVALID_ARGUMENT naming the field: temperature must be finite and
/// >= 0, top_k >= 0, top_p finite in (0, 1], presence_penalty and
/// frequency_penalty finite in [-2, 2] (OpenAI's range), repetition_penalty
/// finite and > 0 (vLLM's rule), min_p in [0, 1], logit_bias of at most
/// kMaxLogitBias entries with ids >= 0 ascending and each bias finite in
/// [-100, 100] (OpenAI's range; the vocabulary is the model's to check). A
/// top_k larger than the vocabulary is allowed (it keeps everything, as HF
/// does).
absl::Status ValidateSamplingParams(const SamplingParams& params);

/// Sparse distribution over the support left after the sampling transform:
/// (token id, probability), sorted by probability descending, equal
/// probabilities by lower id first; probabilities sum to 1 (within float
/// rounding). Tokens whose probability is 0 are not listed.
using SparseDist = std::vector<std::pair<int, float>>;

/// min_p's cut-off: the logit a token needs to stay, max + T * ln(min_p)
/// (its probability at temperature T is then >= min_p times the
/// likeliest's); -inf when min_p is 0 or the params are greedy. NaN logits
/// are never the max. In double, so a device computes the same set.
double MinPLogitThreshold(absl::Span<const float> logits,
                          const SamplingParams& params);

/// The sampling transform, in vLLM's order:
/// logits / temperature -> softmax -> min_p -> top-k -> top-p -> renormalise
/// (min_p keeps the tokens whose logit is >= MinPLogitThreshold; it and
/// top-k each keep a prefix of the descending order, so their order does
/// not matter).
/// top-p acts on the probabilities renormalised over the top-k set (as HF's
/// TopPLogitsWarper and vLLM's sampler do) and keeps the smallest prefix, in
/// descending order, whose cumulative probability is >= top_p (at least one
/// token). Greedy params => {(Argmax(logits), 1)}.
///
/// logits: [vocab]. NaN logits are treated as -inf; +inf logits share the mass
/// uniformly. Returns {} for empty logits; params are assumed valid
/// (ValidateSamplingParams).
/// Cost: top_k <= 4096 streams the logits through a k-entry heap (then only
/// k exps); larger top_k uses nth_element; top_p < 1 partially sorts growing
/// prefixes; only when neither cuts the support is it fully sorted (LSD radix
/// sort). Softmax runs in double after max subtraction. At a 128k vocabulary
/// top_k 20 costs ~0.1 ms, top_p ~1 ms, the full support ~3 ms (2-core dev
/// box). Uses thread-local scratch buffers; safe to call from many threads.
SparseDist ComputeDistribution(absl::Span<const float> logits,
                               const SamplingParams& params);

/// Index of the largest logit; ties -> lowest id; NaN never wins (unless all
/// are NaN, then 0). logits: [vocab], must be non-empty (returns -1 if empty).
int Argmax(absl::Span<const float> logits);

/// Seeded, reproducible generator: the same seed gives the same sequence on
/// every platform. std::mt19937_64 (its output is fixed by the C++ standard)
/// plus our own [0, 1) double from the top 53 bits, because
/// std::uniform_real_distribution is implementation-defined.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  /// Next raw 64-bit output of mt19937_64.
  uint64_t Next() { return engine_(); }
  /// Uniform double in [0, 1): (Next() >> 11) * 2^-53.
  double Uniform() {
    return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0);
  }

 private:
  std::mt19937_64 engine_;
};

/// Inverse-CDF draw from `dist` in its listed order with one Uniform():
/// the first entry whose cumulative probability exceeds u * total (total =
/// the sum of the listed probabilities, so a dist that is off 1 by rounding,
/// or unnormalised, is still sampled proportionally). Zero-probability
/// entries are never returned. Returns -1 for an empty or all-zero dist.
int SampleFrom(const SparseDist& dist, Rng* rng);

/// The probability `dist` lists for `id`, 0 when it lists none (a linear
/// scan: dist is sorted by probability, not id).
float ProbabilityOf(const SparseDist& dist, int id);

/// SampleFrom's inverse-CDF walk at a given u in [0, 1): the first listed
/// entry whose cumulative probability exceeds u * total; never a
/// zero-probability entry; -1 for an empty or all-zero dist.
int SampleAt(const SparseDist& dist, double u);

/// One sampling step: greedy -> Argmax(logits) (rng unused, may be null);
/// otherwise SampleFrom(ComputeDistribution(logits, params), rng).
int SampleToken(absl::Span<const float> logits, const SamplingParams& params,
                Rng* rng);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_SAMPLING_H_
