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

}  // namespace
}  // namespace specserve
