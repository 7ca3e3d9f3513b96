#ifndef SPECSERVE_SPECULATOR_SERVICE_METRICS_H_
#define SPECSERVE_SPECULATOR_SERVICE_METRICS_H_

#include <cstdint>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/registry.h"

namespace specserve {

class PagedKvCache;

/// The speculator's Prometheus metrics (prometheus-cpp; base units,
/// counters end in _total, latencies as histograms: docs/ARCHITECTURE.md, Conventions).
/// All updates are thread-safe.
class SpeculatorMetrics {
 public:
  /// Registers every family in `registry`, which must outlive this object.
  explicit SpeculatorMetrics(prometheus::Registry& registry);

  /// One finished RPC: `method` (Score, Draft, ReleaseSession, Info) and its
  /// canonical status code name (e.g. "OK", "INVALID_ARGUMENT").
  void CountRequest(const std::string& method, const std::string& code);
  /// One successful Score: prompt and kept token counts, phase latencies in
  /// nanoseconds (total = receipt to reply, queueing included).
  void ObserveScore(int prompt_tokens, int kept_tokens, int64_t prefill_ns,
                    int64_t look_ahead_ns, int64_t score_ns, int64_t total_ns);
  /// One Draft round that proposed `tokens` drafts in `ns` nanoseconds.
  void ObserveDraft(int tokens, int64_t ns);
  /// Live sessions (the session manager's observer, whose calls never
  /// overlap).
  void SetSessions(int sessions);
  /// The bytes of the KV blocks sequences hold and the fraction of the
  /// pool they hold, [0, 1] (kv_cache_usage_perc), read from `kv` under
  /// this object's lock: the scheduler's loop and the session observer both
  /// call it, and the last call reports the final state (values read
  /// before an overlapping call could be set last and stay while idle).
  void SetKv(const PagedKvCache& kv);
  /// One step of the batching scheduler: operations and rows in its
  /// forward (a step without a forward observes no batch), operations in
  /// flight that waited, sessions preempted for KV blocks.
  /// `prefix_queries` / `prefix_hits`: the KV cache's running totals of
  /// prompt tokens looked up in / supplied by the prefix cache.
  void ObserveStep(int sequences, int rows, int waiting, int preempted,
                   int64_t prefix_queries, int64_t prefix_hits);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& kept_tokens_;
  prometheus::Histogram& keep_ratio_;
  prometheus::Family<prometheus::Histogram>& score_family_;
  prometheus::Histogram& prefill_seconds_;
  prometheus::Histogram& look_ahead_seconds_;
  prometheus::Histogram& score_seconds_;
  prometheus::Histogram& total_seconds_;
  prometheus::Counter& draft_rounds_;
  prometheus::Counter& draft_tokens_;
  prometheus::Histogram& draft_seconds_;
  prometheus::Gauge& active_sessions_;
  prometheus::Gauge& kv_bytes_;
  prometheus::Counter& preemptions_;
  prometheus::Histogram& batch_sequences_;
  prometheus::Histogram& batch_tokens_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& kv_usage_;
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_hits_;
  int64_t seen_queries_ = 0, seen_hits_ = 0;  // only the loop thread
  absl::Mutex kv_mu_;                          // SetKv's read-and-set
};

}  // namespace specserve

#endif  // SPECSERVE_SPECULATOR_SERVICE_METRICS_H_
