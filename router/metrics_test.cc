#include "router/metrics.h"

#include <string>

#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace specserve {
namespace {

TEST(FallbackLabelTest, KnownReasonsKeepTheirNameWithoutDetail) {
  EXPECT_EQ(RouterMetrics::FallbackLabel("speculator_unavailable"),
            "speculator_unavailable");
  EXPECT_EQ(RouterMetrics::FallbackLabel("speculator_busy"), "speculator_busy");
  EXPECT_EQ(RouterMetrics::FallbackLabel("speculator_error: INTERNAL"),
            "speculator_error");
  EXPECT_EQ(RouterMetrics::FallbackLabel(
                "speculator_failed_mid_generation: UNAVAILABLE"),
            "speculator_failed_mid_generation");
}

TEST(FallbackLabelTest, AnythingElseIsOther) {
  EXPECT_EQ(RouterMetrics::FallbackLabel("no such reason"), "other");
  EXPECT_EQ(RouterMetrics::FallbackLabel(""), "other");
  EXPECT_EQ(RouterMetrics::FallbackLabel("speculator_error_x: y"), "other");
}

// Status texts (which carry free-form messages) never become label values:
// a thousand distinct reasons make at most the fixed set of series.
TEST(RouterMetricsTest, FallbackSeriesStayBounded) {
  prometheus::Registry registry;
  RouterMetrics m(registry);
  for (int i = 0; i < 1000; ++i) {
    m.CountFallback("speculator_error: INTERNAL: message " + std::to_string(i));
    m.CountFallback("weird " + std::to_string(i));
  }
  const std::string text =
      prometheus::TextSerializer().Serialize(registry.Collect());
  int series = 0;
  for (size_t at = text.find("specserve_router_fallbacks_total{");
       at != std::string::npos;
       at = text.find("specserve_router_fallbacks_total{", at + 1)) {
    ++series;
  }
  EXPECT_EQ(series, 2) << text;
  EXPECT_NE(text.find("reason=\"speculator_error\"} 1000"), std::string::npos)
      << text;
  EXPECT_NE(text.find("reason=\"other\"} 1000"), std::string::npos) << text;
}

TEST(MethodLabelTest, KnownMethodsElseNone) {
  EXPECT_EQ(RouterMetrics::MethodLabel("draft"), "draft");
  EXPECT_EQ(RouterMetrics::MethodLabel("ngram"), "ngram");
  EXPECT_EQ(RouterMetrics::MethodLabel("draft_tree"), "draft_tree");
  EXPECT_EQ(RouterMetrics::MethodLabel(""), "none");
  EXPECT_EQ(RouterMetrics::MethodLabel("eagle"), "none");
}

// The speculative decoding series are split by method, and the target
// forwards with the tokens they emitted give tokens per forward by method.
TEST(RouterMetricsTest, SpecDecodeSeriesAreLabelledByMethod) {
  prometheus::Registry registry;
  RouterMetrics m(registry);
  // An ngram request: prefill (1 token, 2 drafts none accepted), then a
  // round of 4 drafts with 3 accepted (4 tokens).
  m.ObserveTargetForward("ngram", 1);
  m.ObserveVerifyRound("ngram", 2, 0);
  m.ObserveTargetForward("ngram", 4);
  m.ObserveVerifyRound("ngram", 4, 3);
  // A draft-model request's round, and a request without drafting.
  m.ObserveTargetForward("draft", 2);
  m.ObserveVerifyRound("draft", 4, 1);
  m.ObserveTargetForward("", 1);
  m.ObserveVerifyRound("", 0, 0);  // no drafts: not a verify round
  const std::string text =
      prometheus::TextSerializer().Serialize(registry.Collect());
  const auto has = [&](const std::string& line) {
    return text.find(line) != std::string::npos;
  };
  EXPECT_TRUE(has("specserve_router_spec_decode_num_drafts_total"
                  "{method=\"ngram\"} 2")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_draft_tokens_total"
                  "{method=\"ngram\"} 6")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_accepted_tokens_total"
                  "{method=\"ngram\"} 3")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_accepted_tokens_total"
                  "{method=\"draft\"} 1")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_accepted_tokens_per_pos_"
                  "total{method=\"ngram\",position=\"2\"} 1")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_target_forwards_total"
                  "{method=\"ngram\"} 2")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_emitted_tokens_total"
                  "{method=\"ngram\"} 5")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_target_forwards_total"
                  "{method=\"none\"} 1")) << text;
  EXPECT_FALSE(has("specserve_router_spec_decode_num_drafts_total"
                   "{method=\"none\"}")) << text;
  // Series of methods not used yet exist at 0 (rate() needs a start).
  EXPECT_TRUE(has("specserve_router_spec_decode_num_drafts_total"
                  "{method=\"draft_tree\"} 0")) << text;
  EXPECT_TRUE(has("specserve_router_spec_decode_num_target_forwards_total"
                  "{method=\"draft_tree\"} 0")) << text;
}

}  // namespace
}  // namespace specserve
