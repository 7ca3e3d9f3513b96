#include "common/scheduling/admission_queue.h"

#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(AdmissionQueueTest, AdmitsThenQueuesInOrderThenRefuses) {
  std::vector<std::pair<int, int>> seen;
  AdmissionQueue q({/*max_running=*/2, /*max_waiting=*/2}, nullptr,
                   [&](int r, int w) { seen.emplace_back(r, w); });
  std::vector<int> admitted;
  EXPECT_EQ(*q.AdmitOrWait([] {}), 0u);
  EXPECT_EQ(*q.AdmitOrWait([] {}), 0u);
  auto t1 = q.AdmitOrWait([&] { admitted.push_back(1); });
  auto t2 = q.AdmitOrWait([&] { admitted.push_back(2); });
  ASSERT_TRUE(t1.ok() && t2.ok());
  EXPECT_GT(*t1, 0u);
  EXPECT_GT(*t2, *t1);
  auto full = q.AdmitOrWait([] {});
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("max_waiting_requests"),
            std::string::npos)
      << full.status();
  EXPECT_EQ(q.running(), 2);
  EXPECT_EQ(q.waiting(), 2);
  q.Release();  // first come, first served
  EXPECT_EQ(admitted, std::vector<int>({1}));
  EXPECT_EQ(q.running(), 2);
  EXPECT_TRUE(q.CancelWaiting(*t2));
  EXPECT_FALSE(q.CancelWaiting(*t2));
  EXPECT_FALSE(q.CancelWaiting(*t1));  // already admitted
  q.Release();
  q.Release();
  EXPECT_EQ(admitted, std::vector<int>({1}));
  EXPECT_EQ(q.running(), 0);
  EXPECT_EQ(q.waiting(), 0);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), std::make_pair(0, 0));  // the gauges end idle
}

TEST(AdmissionQueueTest, NoWaitingRoomRefusesNamingTheLimit) {
  AdmissionQueue::Options o;
  o.max_running = 1;
  o.max_waiting = 0;
  o.running_flag = "max_sessions";
  AdmissionQueue q(o);
  EXPECT_EQ(*q.AdmitOrWait(nullptr), 0u);
  auto s = q.AdmitOrWait(nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.status().message().find("max_sessions"), std::string::npos);
  q.Release();
  EXPECT_EQ(*q.AdmitOrWait(nullptr), 0u);
}

TEST(AdmissionQueueTest, AdmittedCallbacksGoThroughTheRunner) {
  std::vector<std::function<void()>> deferred;
  AdmissionQueue q({1, 4},
                   [&](std::function<void()> f) { deferred.push_back(f); });
  int ran = 0;
  EXPECT_EQ(*q.AdmitOrWait(nullptr), 0u);
  EXPECT_GT(*q.AdmitOrWait([&] { ++ran; }), 0u);
  q.Release();
  EXPECT_EQ(ran, 0);  // not inline
  ASSERT_EQ(deferred.size(), 1u);
  deferred[0]();
  EXPECT_EQ(ran, 1);
}

}  // namespace
}  // namespace specserve
