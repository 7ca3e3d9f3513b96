#ifndef SPECSERVE_ROUTER_METRICS_H_
#define SPECSERVE_ROUTER_METRICS_H_

#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace specserve {

/// The router's Prometheus metrics, prefix `specserve_router_` (base units,
/// counters end in _total, latencies as histograms; the speculative decoding
/// counters are named like vLLM V1's: docs/ARCHITECTURE.md, Conventions).
/// Acceptance rate = accepted / draft_tokens; mean acceptance length =
/// 1 + accepted / num_drafts; tokens per target forward = emitted tokens /
/// target forwards. The speculative decoding series carry a `method` label
/// (kMethods). All updates are thread-safe.
class RouterMetrics {
 public:
  /// Registers every family in `registry`, which must outlive this object.
  explicit RouterMetrics(prometheus::Registry& registry);

  /// One finished request with its canonical status name ("OK", ...).
  void CountRequest(const std::string& status);
  /// The values of fallbacks_total's `reason` label: a fixed set, so the
  /// series stay few whatever the speculator answers.
  static constexpr const char* kFallbackReasons[] = {
      "speculator_unavailable",   // down or unreachable
      "speculator_deadline",      // Score past --speculator_deadline_ms
      "speculator_busy",          // RESOURCE_EXHAUSTED: at its limits
      "speculator_error",         // any other error status
      "speculator_bad_response",  // an answer that fails validation
      "speculator_failed_mid_generation",  // Draft stream broke later
  };
  /// The label for a response's fallback_reason: its part before ':' when
  /// that is one of kFallbackReasons, else "other".
  static std::string FallbackLabel(const std::string& reason);
  /// One request served with a degraded plan (`reason` as in the response's
  /// stats; counted under FallbackLabel(reason)).
  void CountFallback(const std::string& reason);
  /// Requests admitted and not yet finished.
  void SetInFlight(int n);

  /// A completed request's latencies (seconds) and token counts. tpot_s < 0
  /// means "not defined" (fewer than two tokens) and is not observed.
  void ObserveCompletion(double ttft_s, double tpot_s, double e2e_s,
                         int prompt_tokens, int kept_tokens,
                         int completion_tokens);
  /// The values of the speculative decoding series' `method` label: the
  /// request's spec_decode_method, or "none" for a request that drafted
  /// nothing (target forwards only). Anything else is counted as "none".
  static constexpr const char* kMethods[] = {"draft", "ngram", "draft_tree",
                                             "none"};
  /// The label for a method name ("" = "none"; see kMethods).
  static std::string MethodLabel(const std::string& method);
  /// One verify round of a request drafting by `method` that carried
  /// `num_draft_tokens` drafts of which the first `num_accepted` were
  /// accepted. Rounds without drafts are not counted.
  void ObserveVerifyRound(const std::string& method, int num_draft_tokens,
                          int num_accepted);
  /// One target forward (the prefill or a verify round) of a request
  /// drafting by `method` ("" = none) that emitted `emitted_tokens`.
  void ObserveTargetForward(const std::string& method, int emitted_tokens);
  /// A round whose drafts the load rule cut: to none (`disabled`) or to
  /// fewer than requested.
  void CountLoadLimitedRound(bool disabled);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& fallbacks_;
  prometheus::Gauge& in_flight_;
  prometheus::Histogram& ttft_;
  prometheus::Histogram& tpot_;
  prometheus::Histogram& e2e_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& kept_tokens_;
  prometheus::Counter& completion_tokens_;
  prometheus::Histogram& keep_ratio_;
  prometheus::Family<prometheus::Counter>& num_drafts_;
  prometheus::Family<prometheus::Counter>& num_draft_tokens_;
  prometheus::Family<prometheus::Counter>& num_accepted_;
  prometheus::Family<prometheus::Counter>& num_target_forwards_;
  prometheus::Family<prometheus::Counter>& num_emitted_tokens_;
  prometheus::Family<prometheus::Counter>& accepted_per_pos_;
  prometheus::Family<prometheus::Counter>& load_limited_;
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_METRICS_H_
