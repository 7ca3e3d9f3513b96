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
/// counters are named like vLLM V1's: docs REFERENCE.md section 3).
/// Acceptance rate = accepted / draft_tokens; mean acceptance length =
/// 1 + accepted / num_drafts. All updates are thread-safe.
class RouterMetrics {
 public:
  /// Registers every family in `registry`, which must outlive this object.
  explicit RouterMetrics(prometheus::Registry& registry);

  /// One finished request with its canonical status name ("OK", ...).
  void CountRequest(const std::string& status);
  /// One request served with a degraded plan (fallback reason string).
  void CountFallback(const std::string& reason);
  /// Requests admitted and not yet finished.
  void SetInFlight(int n);

  /// A completed request's latencies (seconds) and token counts. tpot_s < 0
  /// means "not defined" (fewer than two tokens) and is not observed.
  void ObserveCompletion(double ttft_s, double tpot_s, double e2e_s,
                         int prompt_tokens, int kept_tokens,
                         int completion_tokens);
  /// One verify round that carried `num_draft_tokens` drafts of which the
  /// first `num_accepted` were accepted.
  void ObserveVerifyRound(int num_draft_tokens, int num_accepted);
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
  prometheus::Counter& num_drafts_;
  prometheus::Counter& num_draft_tokens_;
  prometheus::Counter& num_accepted_;
  prometheus::Family<prometheus::Counter>& accepted_per_pos_;
  prometheus::Family<prometheus::Counter>& load_limited_;
};

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_METRICS_H_
