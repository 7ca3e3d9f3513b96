#include "common/decoding/sampling.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Up to this top_k the selection streams through a heap of k entries;
// above it nth_element over the whole vocabulary is cheaper.
constexpr int kHeapTopK = 4096;
// Full sorts of more candidates than this use the radix sort.
constexpr size_t kRadixMin = 2048;

// Candidates are packed into one uint64 whose ascending order is the output
// order: logit descending in the high 32 bits, id ascending in the low 32.
// Integer compares make selection and sorting several times cheaper than a
// (float, int) comparator at 128k-entry vocabularies.
using SortKey = uint64_t;

// Order-preserving float -> uint32 map. NaN becomes -inf and -0 becomes +0
// so that the order agrees with float comparison.
// Branch-free: logit signs are random, and a mispredicted branch per entry
// costs more than the rest of the pass.
inline uint32_t OrderedBits(float f) {
  f = std::isnan(f) ? kNegInf : f + 0.f;  // f + 0: -0 -> +0
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  const uint32_t sign_mask =
      static_cast<uint32_t>(static_cast<int32_t>(b) >> 31);
  return b ^ (sign_mask | 0x80000000u);
}

inline float FromOrderedBits(uint32_t u) {
  const uint32_t b = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline SortKey MakeKey(float logit, int id) {
  return (static_cast<uint64_t>(~OrderedBits(logit)) << 32) |
         static_cast<uint32_t>(id);
}
inline float KeyLogit(SortKey k) {
  return FromOrderedBits(~static_cast<uint32_t>(k >> 32));
}
inline int KeyId(SortKey k) { return static_cast<int>(k & 0xffffffffu); }

// LSD radix sort of the keys, 8-bit digits; digits on which all keys agree
// (shared sign/exponent bytes, unused id bits) are skipped. LSD is stable,
// so when the keys arrive in id order the id half needs no passes at all.
void RadixSort(bool in_id_order, std::vector<SortKey>* keys) {
  const int first_shift = in_id_order ? 32 : 0;
  constexpr int kDigits = 8;
  std::array<std::array<uint32_t, 256>, kDigits> count{};
  for (const SortKey k : *keys) {
    for (int d = first_shift / 8; d < kDigits; ++d) ++count[d][(k >> (8 * d)) & 0xff];
  }
  thread_local std::vector<SortKey> scratch;  // reused: no page faults
  scratch.resize(keys->size());
  std::vector<SortKey>* src = keys;
  std::vector<SortKey>* dst = &scratch;
  for (int d = first_shift / 8; d < kDigits; ++d) {
    std::array<uint32_t, 256>& c = count[d];
    if (std::count(c.begin(), c.end(), src->size()) == 1) continue;
    uint32_t offset = 0;
    for (uint32_t& bin : c) {
      const uint32_t n = bin;
      bin = offset;
      offset += n;
    }
    const int shift = 8 * d;
    for (const SortKey k : *src) (*dst)[c[(k >> shift) & 0xff]++] = k;
    std::swap(src, dst);
  }
  if (src != keys) keys->swap(scratch);
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& params) {
  if (!std::isfinite(params.temperature) || params.temperature < 0.f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0 (0 = greedy), "
                     "got ",
                     params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_k must be >= 0 (0 = off), got ", params.top_k));
  }
  if (!std::isfinite(params.top_p) || params.top_p <= 0.f ||
      params.top_p > 1.f) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", params.top_p));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, float>{"presence_penalty",
                                      params.presence_penalty},
        {"frequency_penalty", params.frequency_penalty}}) {
    if (!(value >= -2.f && value <= 2.f)) {  // also NaN
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be in [-2, 2], got ", value));
    }
  }
  if (!(params.min_p >= 0.f && params.min_p <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_p must be in [0, 1] (0 = off), got ", params.min_p));
  }
  if (params.logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias has ", params.logit_bias.size(),
                     " entries; at most ", kMaxLogitBias, " are allowed"));
  }
  for (size_t i = 0; i < params.logit_bias.size(); ++i) {
    const auto [id, bias] = params.logit_bias[i];
    if (id < 0 || (i > 0 && id <= params.logit_bias[i - 1].first)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias ids must be >= 0, ascending and distinct, got ", id));
    }
    if (!(bias >= -100.f && bias <= 100.f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias[", id, "] must be in [-100, 100], got ", bias));
    }
  }
  if (!std::isfinite(params.repetition_penalty) ||
      params.repetition_penalty <= 0.f) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be a finite number > 0 (1 = "
                     "off), got ",
                     params.repetition_penalty));
  }
  return absl::OkStatus();
}

int Argmax(absl::Span<const float> logits) {
  if (logits.empty()) return -1;
  // NaN compares false, so it never wins; starting from -inf makes an
  // all -inf/NaN row return 0.
  int best = 0;
  float best_key = kNegInf;
  for (int i = 0; i < static_cast<int>(logits.size()); ++i) {
    if (logits[i] > best_key) {  // strict: ties keep the lower id
      best_key = logits[i];
      best = i;
    }
  }
  return best;
}

double MinPLogitThreshold(absl::Span<const float> logits,
                          const SamplingParams& params) {
  if (params.min_p <= 0.f || params.greedy()) return -HUGE_VAL;
  float max = kNegInf;
  for (const float x : logits) {
    if (x > max) max = x;  // NaN never wins
  }
  return static_cast<double>(max) +
         static_cast<double>(params.temperature) *
             std::log(static_cast<double>(params.min_p));
}

SparseDist ComputeDistribution(absl::Span<const float> logits,
                               const SamplingParams& params) {
  if (logits.empty()) return {};
  if (params.greedy()) return {{Argmax(logits), 1.f}};
  if (params.min_p > 0.f) {
    // min_p first, as a mask of the logits below its threshold: the kept
    // set is a prefix of the descending order, so top-k and top-p then act
    // on it as they act on the whole row.
    const double threshold = MinPLogitThreshold(logits, params);
    thread_local std::vector<float> masked;
    masked.resize(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) {
      masked[i] = static_cast<double>(logits[i]) >= threshold ? logits[i]
                                                              : kNegInf;
    }
    SamplingParams rest;
    rest.temperature = params.temperature;
    rest.top_k = params.top_k;
    rest.top_p = params.top_p;
    return ComputeDistribution(masked, rest);  // rest has no min_p
  }

  const int vocab = static_cast<int>(logits.size());
  const int top_k = params.top_k;
  std::vector<SortKey> cand;
  if (top_k > 0 && top_k <= kHeapTopK && top_k < vocab) {
    // Small top-k: one streaming pass keeping the k best in a max-heap whose
    // front is the worst kept key; for typical logits only
    // O(k log(vocab / k)) entries ever touch the heap. The admission test is
    // a plain float compare: ids arrive in increasing order, so a logit equal
    // to the worst kept one loses the tie, and NaN compares false.
    cand.reserve(top_k);
    for (int i = 0; i < top_k; ++i) cand.push_back(MakeKey(logits[i], i));
    std::make_heap(cand.begin(), cand.end());
    float worst = KeyLogit(cand.front());
    for (int i = top_k; i < vocab; ++i) {
      if (logits[i] > worst) {
        std::pop_heap(cand.begin(), cand.end());
        cand.back() = MakeKey(logits[i], i);
        std::push_heap(cand.begin(), cand.end());
        worst = KeyLogit(cand.front());
      }
    }
  } else {
    cand.resize(vocab);
    for (int i = 0; i < vocab; ++i) cand[i] = MakeKey(logits[i], i);
    if (top_k > 0 && top_k < vocab) {  // large top-k: O(vocab) selection
      std::nth_element(cand.begin(), cand.begin() + top_k, cand.end());
      cand.resize(top_k);
    }
  }

  const float max_logit = KeyLogit(*std::min_element(cand.begin(), cand.end()));
  if (max_logit == kNegInf) return {{Argmax(logits), 1.f}};  // no finite logit

  // Softmax in double after max subtraction: weight = exp(-gap), where gap =
  // (max - logit) / T >= 0. The equality test covers +inf logits (inf - inf
  // would be NaN).
  const double inv_t = 1.0 / static_cast<double>(params.temperature);
  auto gap = [&](float logit) -> double {
    return logit == max_logit
               ? 0.0
               : (static_cast<double>(max_logit) - logit) * inv_t;
  };
  // Weights by token id, so each exp is computed once. Reused per thread:
  // a fresh 1 MB buffer per call would page-fault on every call.
  thread_local std::vector<double> weight_of;
  if (weight_of.size() < static_cast<size_t>(vocab)) weight_of.resize(vocab);
  auto weight = [&](SortKey k) { return weight_of[KeyId(k)]; };

  // One pass: weights and total mass. Candidates whose weight underflows to
  // 0 are outside the support and are dropped.
  double total = 0.0;
  size_t n = 0;
  for (const SortKey k : cand) {
    const double g = gap(KeyLogit(k));
    const double w = std::exp(-g);
    if (w > 0.0) {
      weight_of[KeyId(k)] = w;
      total += w;
      cand[n++] = k;
    }
  }
  cand.resize(n);

  // Top-p over the (renormalised) top-k set.
  size_t keep = n;
  double kept_mass = total;
  if (params.top_p < 1.f) {
    const double target = static_cast<double>(params.top_p) * total;
    // Sort only as far as needed: partial_sort growing prefixes until the
    // cumulative mass reaches top_p.
    double cum = 0.0;
    size_t sorted = 0;
    keep = 0;
    while (keep == 0 && sorted < n) {
      const size_t upto = std::min(n, std::max<size_t>(64, sorted * 4));
      std::partial_sort(cand.begin() + sorted, cand.begin() + upto, cand.end());
      for (size_t i = sorted; i < upto; ++i) {
        cum += weight(cand[i]);
        if (cum >= target) {
          keep = i + 1;
          break;
        }
      }
      sorted = upto;
    }
    // Rounding left cum just short of target: the whole set is the
    // smallest prefix reaching it.
    if (keep == 0) keep = n;
    kept_mass = cum;
  } else if (n >= kRadixMin) {
    // Only the streaming heap and nth_element reorder candidates.
    const bool in_id_order = !(top_k > 0 && top_k < vocab);
    RadixSort(in_id_order, &cand);
  } else {
    std::sort(cand.begin(), cand.end());
  }

  SparseDist dist;
  dist.reserve(keep);
  const double inv_mass = 1.0 / kept_mass;
  for (size_t i = 0; i < keep; ++i) {
    const float p = static_cast<float>(weight(cand[i]) * inv_mass);
    if (p <= 0.f) break;  // descending: the rest are 0 too
    dist.emplace_back(KeyId(cand[i]), p);
  }
  if (dist.empty()) dist.emplace_back(KeyId(cand[0]), 1.f);

  // Distinct logits can round to the same float probability; restore the
  // documented tie order (lower id first) within such runs.
  for (size_t i = 0; i < dist.size();) {
    size_t j = i + 1;
    while (j < dist.size() && dist[j].second == dist[i].second) ++j;
    if (j - i > 1) {
      std::sort(dist.begin() + i, dist.begin() + j,
                [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    i = j;
  }
  return dist;
}

float ProbabilityOf(const SparseDist& dist, int id) {
  for (const auto& e : dist) {
    if (e.first == id) return e.second;
  }
  return 0.f;
}

int SampleAt(const SparseDist& dist, double u) {
  double total = 0.0;
  for (const auto& e : dist) total += e.second;
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double cum = 0.0;
  int last_positive = -1;
  for (const auto& e : dist) {
    if (e.second <= 0.f) continue;
    cum += e.second;
    last_positive = e.first;
    if (cum > target) return e.first;
  }
  return last_positive;  // target rounded past the final cumulative sum
}

int SampleFrom(const SparseDist& dist, Rng* rng) {
  // No draw for a dist with nothing to sample (a seeded stream stays put).
  double total = 0.0;
  for (const auto& e : dist) total += e.second;
  if (!(total > 0.0)) return -1;
  return SampleAt(dist, rng->Uniform());
}

int SampleToken(absl::Span<const float> logits, const SamplingParams& params,
                Rng* rng) {
  if (params.greedy()) return Argmax(logits);
  return SampleFrom(ComputeDistribution(logits, params), rng);
}

}  // namespace specserve
