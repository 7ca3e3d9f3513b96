#include "router/metrics.h"

#include "common/service/metrics_util.h"

namespace specserve {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

}  // namespace

RouterMetrics::RouterMetrics(prometheus::Registry& r)
    : requests_(BuildCounter()
                    .Name("specserve_router_requests_total")
                    .Help("Finished Generate / GenerateStream requests by "
                          "gRPC status code")
                    .Register(r)),
      fallbacks_(BuildCounter()
                     .Name("specserve_router_fallbacks_total")
                     .Help("Requests served without (part of) the speculator, "
                           "by reason")
                     .Register(r)),
      in_flight_(BuildGauge()
                     .Name("specserve_router_in_flight_requests")
                     .Help("Requests admitted and not yet finished")
                     .Register(r)
                     .Add({})),
      ttft_(BuildHistogram()
                .Name("specserve_router_ttft_seconds")
                .Help("Request receipt to the first generated token")
                .Register(r)
                .Add({}, ExponentialBuckets(1e-4, 2, 20))),
      tpot_(BuildHistogram()
                .Name("specserve_router_time_per_output_token_seconds")
                .Help("(end-to-end - TTFT) / (completion tokens - 1)")
                .Register(r)
                .Add({}, ExponentialBuckets(1e-5, 2, 20))),
      e2e_(BuildHistogram()
               .Name("specserve_router_e2e_latency_seconds")
               .Help("Request receipt to the last token")
               .Register(r)
               .Add({}, ExponentialBuckets(1e-3, 2, 20))),
      prompt_tokens_(BuildCounter()
                         .Name("specserve_router_prompt_tokens_total")
                         .Help("Prompt tokens of completed requests")
                         .Register(r)
                         .Add({})),
      kept_tokens_(BuildCounter()
                       .Name("specserve_router_kept_prompt_tokens_total")
                       .Help("Prompt tokens the target prefilled (after "
                             "Speculative Prefill)")
                       .Register(r)
                       .Add({})),
      completion_tokens_(BuildCounter()
                             .Name("specserve_router_completion_tokens_total")
                             .Help("Generated tokens of completed requests")
                             .Register(r)
                             .Add({})),
      keep_ratio_(BuildHistogram()
                      .Name("specserve_router_keep_ratio")
                      .Help("Kept / prompt tokens per completed request")
                      .Register(r)
                      .Add({}, RatioBuckets())),
      num_drafts_(BuildCounter()
                      .Name("specserve_router_spec_decode_num_drafts_total")
                      .Help("Verify rounds that carried drafts, by method")
                      .Register(r)),
      num_draft_tokens_(
          BuildCounter()
              .Name("specserve_router_spec_decode_num_draft_tokens_total")
              .Help("Draft tokens verified, by method")
              .Register(r)),
      num_accepted_(
          BuildCounter()
              .Name("specserve_router_spec_decode_num_accepted_tokens_total")
              .Help("Draft tokens accepted, by method")
              .Register(r)),
      num_target_forwards_(
          BuildCounter()
              .Name("specserve_router_spec_decode_num_target_forwards_total")
              .Help("Target forwards (prefill and verify rounds) by the "
                    "request's drafting method (none = no drafts)")
              .Register(r)),
      num_emitted_tokens_(
          BuildCounter()
              .Name("specserve_router_spec_decode_num_emitted_tokens_total")
              .Help("Tokens the target forwards emitted, by the request's "
                    "drafting method; / num_target_forwards_total = tokens "
                    "per target forward")
              .Register(r)),
      accepted_per_pos_(
          BuildCounter()
              .Name("specserve_router_spec_decode_num_accepted_tokens_per_"
                    "pos_total")
              .Help("Accepted drafts by position in the round (0-based) "
                    "and method")
              .Register(r)),
      load_limited_(
          BuildCounter()
              .Name("specserve_router_spec_decode_load_limited_rounds_total")
              .Help("Rounds whose drafts --spec_decode_disable_by_batch_size "
                    "cut, by action (disabled: none; reduced: fewer)")
              .Register(r)) {
  // Every method's series from 0, so rate() sees a request's first
  // increment (a series born at its first value would show no increase).
  for (const char* m : kMethods) {
    if (std::string(m) != "none") {
      num_drafts_.Add({{"method", m}});
      num_draft_tokens_.Add({{"method", m}});
      num_accepted_.Add({{"method", m}});
    }
    num_target_forwards_.Add({{"method", m}});
    num_emitted_tokens_.Add({{"method", m}});
  }
}

void RouterMetrics::CountRequest(const std::string& status) {
  requests_.Add({{"status", status}}).Increment();
}

std::string RouterMetrics::FallbackLabel(const std::string& reason) {
  const std::string head = reason.substr(0, reason.find(':'));
  for (const char* r : kFallbackReasons) {
    if (head == r) return head;
  }
  return "other";
}

void RouterMetrics::CountFallback(const std::string& reason) {
  fallbacks_.Add({{"reason", FallbackLabel(reason)}}).Increment();
}

void RouterMetrics::SetInFlight(int n) { in_flight_.Set(n); }

void RouterMetrics::ObserveCompletion(double ttft_s, double tpot_s,
                                      double e2e_s, int prompt_tokens,
                                      int kept_tokens, int completion_tokens) {
  if (completion_tokens > 0) ttft_.Observe(ttft_s);
  if (tpot_s >= 0) tpot_.Observe(tpot_s);
  e2e_.Observe(e2e_s);
  prompt_tokens_.Increment(prompt_tokens);
  kept_tokens_.Increment(kept_tokens);
  completion_tokens_.Increment(completion_tokens);
  if (prompt_tokens > 0) {
    keep_ratio_.Observe(static_cast<double>(kept_tokens) / prompt_tokens);
  }
}

std::string RouterMetrics::MethodLabel(const std::string& method) {
  for (const char* m : kMethods) {
    if (method == m) return method;
  }
  return "none";
}

void RouterMetrics::ObserveVerifyRound(const std::string& method,
                                       int num_draft_tokens,
                                       int num_accepted) {
  if (num_draft_tokens <= 0) return;
  const std::string label = MethodLabel(method);
  num_drafts_.Add({{"method", label}}).Increment();
  num_draft_tokens_.Add({{"method", label}}).Increment(num_draft_tokens);
  num_accepted_.Add({{"method", label}}).Increment(num_accepted);
  for (int i = 0; i < num_accepted; ++i) {
    accepted_per_pos_
        .Add({{"method", label}, {"position", std::to_string(i)}})
        .Increment();
  }
}

void RouterMetrics::ObserveTargetForward(const std::string& method,
                                         int emitted_tokens) {
  const std::string label = MethodLabel(method);
  num_target_forwards_.Add({{"method", label}}).Increment();
  num_emitted_tokens_.Add({{"method", label}}).Increment(emitted_tokens);
}

void RouterMetrics::CountLoadLimitedRound(bool disabled) {
  load_limited_.Add({{"action", disabled ? "disabled" : "reduced"}})
      .Increment();
}

}  // namespace specserve
