#include "speculator_service/metrics.h"

#include "common/engine/paged_kv_cache.h"
#include "common/service/metrics_util.h"

namespace specserve {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// 50 us .. ~13 s, x2 per bucket: covers tiny-model decode steps through
// long-prompt prefills of larger speculators.
Histogram::BucketBoundaries LatencyBuckets() {
  return ExponentialBuckets(50e-6, 2, 19);
}

prometheus::Family<Histogram>& ScoreFamily(prometheus::Registry& r) {
  return BuildHistogram()
      .Name("specserve_speculator_score_seconds")
      .Help(
          "Score latency by phase: prefill, look_ahead, score (importance "
          "+ selection), total (receipt to reply)")
      .Register(r);
}

double Seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

}  // namespace

SpeculatorMetrics::SpeculatorMetrics(prometheus::Registry& r)
    : requests_(BuildCounter()
                    .Name("specserve_speculator_requests_total")
                    .Help("Finished RPCs by method and status code")
                    .Register(r)),
      prompt_tokens_(BuildCounter()
                         .Name("specserve_speculator_prompt_tokens_total")
                         .Help("Prompt tokens scored")
                         .Register(r)
                         .Add({})),
      kept_tokens_(BuildCounter()
                       .Name("specserve_speculator_kept_tokens_total")
                       .Help("Prompt tokens kept by Speculative Prefill")
                       .Register(r)
                       .Add({})),
      keep_ratio_(BuildHistogram()
                      .Name("specserve_speculator_keep_ratio")
                      .Help("Kept / prompt tokens per Score")
                      .Register(r)
                      .Add({}, RatioBuckets())),
      score_family_(ScoreFamily(r)),
      prefill_seconds_(
          score_family_.Add({{"phase", "prefill"}}, LatencyBuckets())),
      look_ahead_seconds_(
          score_family_.Add({{"phase", "look_ahead"}}, LatencyBuckets())),
      score_seconds_(score_family_.Add({{"phase", "score"}}, LatencyBuckets())),
      total_seconds_(score_family_.Add({{"phase", "total"}}, LatencyBuckets())),
      draft_rounds_(BuildCounter()
                        .Name("specserve_speculator_draft_rounds_total")
                        .Help("Draft requests answered")
                        .Register(r)
                        .Add({})),
      draft_tokens_(BuildCounter()
                        .Name("specserve_speculator_draft_tokens_total")
                        .Help("Draft tokens proposed")
                        .Register(r)
                        .Add({})),
      draft_seconds_(BuildHistogram()
                         .Name("specserve_speculator_draft_seconds")
                         .Help("Latency of one Draft round")
                         .Register(r)
                         .Add({}, LatencyBuckets())),
      active_sessions_(BuildGauge()
                           .Name("specserve_speculator_active_sessions")
                           .Help("Sessions holding a KV cache")
                           .Register(r)
                           .Add({})),
      kv_bytes_(BuildGauge()
                    .Name("specserve_speculator_kv_bytes")
                    .Help("KV cache bytes of the blocks sessions hold")
                    .Register(r)
                    .Add({})),
      preemptions_(BuildCounter()
                       .Name("specserve_speculator_num_preemptions_total")
                       .Help("Sessions preempted when the KV cache ran out "
                             "of blocks: freed and recomputed later (vLLM "
                             "num_preemptions)")
                       .Register(r)
                       .Add({})),
      batch_sequences_(BuildHistogram()
                           .Name("specserve_speculator_batch_sequences")
                           .Help("Score / Draft operations per batched "
                                 "forward of the scheduler")
                           .Register(r)
                           .Add({}, ExponentialBuckets(1, 2, 10))),
      batch_tokens_(BuildHistogram()
                        .Name("specserve_speculator_batch_tokens")
                        .Help("Rows (tokens) per batched forward, at most "
                              "--max_num_batched_tokens")
                        .Register(r)
                        .Add({}, ExponentialBuckets(1, 2, 16))),
      waiting_(BuildGauge()
                   .Name("specserve_speculator_num_requests_waiting")
                   .Help("Operations in flight that got no rows in the "
                         "last step (token budget full)")
                   .Register(r)
                   .Add({})),
      kv_usage_(BuildGauge()
                    .Name("specserve_speculator_kv_cache_usage_perc")
                    .Help("Fraction of the paged KV cache's blocks in use, "
                          "[0, 1] (vLLM kv_cache_usage_perc)")
                    .Register(r)
                    .Add({})),
      prefix_queries_(
          BuildCounter()
              .Name("specserve_speculator_prefix_cache_queries_total")
              .Help("Prompt tokens looked up in the prefix cache (vLLM "
                    "prefix_cache_queries)")
              .Register(r)
              .Add({})),
      prefix_hits_(BuildCounter()
                       .Name("specserve_speculator_prefix_cache_hits_total")
                       .Help("Prompt tokens the prefix cache supplied, not "
                             "prefilled (vLLM prefix_cache_hits)")
                       .Register(r)
                       .Add({})) {}

void SpeculatorMetrics::ObserveStep(int sequences, int rows, int waiting,
                                    int preempted, int64_t prefix_queries,
                                    int64_t prefix_hits) {
  if (sequences > 0) {
    batch_sequences_.Observe(sequences);
    batch_tokens_.Observe(rows);
  }
  waiting_.Set(waiting);
  preemptions_.Increment(preempted);
  prefix_queries_.Increment(static_cast<double>(prefix_queries - seen_queries_));
  prefix_hits_.Increment(static_cast<double>(prefix_hits - seen_hits_));
  seen_queries_ = prefix_queries;
  seen_hits_ = prefix_hits;
}

void SpeculatorMetrics::CountRequest(const std::string& method,
                                     const std::string& code) {
  requests_.Add({{"method", method}, {"code", code}}).Increment();
}

void SpeculatorMetrics::ObserveScore(int prompt_tokens, int kept_tokens,
                                     int64_t prefill_ns, int64_t look_ahead_ns,
                                     int64_t score_ns, int64_t total_ns) {
  prompt_tokens_.Increment(prompt_tokens);
  kept_tokens_.Increment(kept_tokens);
  if (prompt_tokens > 0) {
    keep_ratio_.Observe(static_cast<double>(kept_tokens) / prompt_tokens);
  }
  prefill_seconds_.Observe(Seconds(prefill_ns));
  look_ahead_seconds_.Observe(Seconds(look_ahead_ns));
  score_seconds_.Observe(Seconds(score_ns));
  total_seconds_.Observe(Seconds(total_ns));
}

void SpeculatorMetrics::ObserveDraft(int tokens, int64_t ns) {
  draft_rounds_.Increment();
  draft_tokens_.Increment(tokens);
  draft_seconds_.Observe(Seconds(ns));
}

void SpeculatorMetrics::SetSessions(int sessions) {
  active_sessions_.Set(sessions);
}

void SpeculatorMetrics::SetKv(const PagedKvCache& kv) {
  absl::MutexLock lock(&kv_mu_);
  kv_bytes_.Set(static_cast<double>(kv.bytes_held()));
  kv_usage_.Set(kv.usage());
}

}  // namespace specserve
