#include "speculator_service/session_manager.h"

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "common/model/weights.h"
#include "common/engine/test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

class SessionManagerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto w = LoadModelWeights("models/stories260K-draft");
    ASSERT_TRUE(w.ok()) << w.status();
    model_ = testing_util::MakeCpuRunner(
                 std::make_shared<const ModelWeights>(*std::move(w)), 64)
                 .release();
  }
  static void TearDownTestSuite() { delete model_; }

  std::unique_ptr<DraftSession> NewSession(int capacity = 64) {
    auto s = DraftSession::Create(model_, capacity, SamplingParams{});
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }
  static size_t Bytes(int capacity) {
    return model_->kv_cache().bytes_per_block() *
           PagedKvCache::BlocksForTokens(capacity,
                                         model_->kv_cache().block_size());
  }

  // Injectable clock: tests move time by hand.
  absl::Time now_ = absl::UnixEpoch();
  SessionManager::Clock clock_ = [this] { return now_; };
  static CpuModelRunner* model_;
};

CpuModelRunner* SessionManagerTest::model_ = nullptr;

TEST_F(SessionManagerTest, IdsAreRandom128BitHexAndLeasesReturn) {
  SessionManager m({}, clock_);
  std::set<std::string> ids;
  for (int i = 0; i < 8; ++i) {
    auto lease = m.Add(NewSession());
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->id().size(), 32u);
    EXPECT_EQ(lease->id().find_first_not_of("0123456789abcdef"),
              std::string::npos);
    EXPECT_NE(lease->session(), nullptr);
    ids.insert(lease->id());
  }
  EXPECT_EQ(ids.size(), 8u);
  EXPECT_EQ(m.num_sessions(), 8);
  // Returned leases can be taken again, one at a time.
  auto a = m.Acquire(*ids.begin());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(m.Acquire(*ids.begin()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  a->Reset();
  EXPECT_TRUE(m.Acquire(*ids.begin()).ok());
  EXPECT_EQ(m.Acquire("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, MaxSessionsAndKvBudgetAreResourceExhausted) {
  SessionManagerOptions o;
  o.max_sessions = 2;
  SessionManager by_count(o, clock_);
  ASSERT_TRUE(by_count.Add(NewSession()).ok());
  ASSERT_TRUE(by_count.Add(NewSession()).ok());
  auto third = by_count.Add(NewSession());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("max_sessions"), std::string::npos);

}

TEST_F(SessionManagerTest, IdleSessionsExpireAfterTtl) {
  SessionManagerOptions o;
  o.ttl = absl::Seconds(10);
  SessionManager m(o, clock_);
  std::string id;
  {
    auto lease = m.Add(NewSession());
    ASSERT_TRUE(lease.ok());
    id = lease->id();
  }
  now_ += absl::Seconds(9);
  EXPECT_TRUE(m.Acquire(id).ok());  // use refreshes the idle timer
  now_ += absl::Seconds(9);
  EXPECT_EQ(m.Sweep(), 0);
  now_ += absl::Seconds(2);
  auto gone = m.Acquire(id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("expired or unknown"),
            std::string::npos);
  EXPECT_EQ(m.num_sessions(), 0);  // reaped lazily on access

  // The periodic sweep reaps without any access.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(m.Add(NewSession()).ok());
  now_ += absl::Seconds(11);
  EXPECT_EQ(m.Sweep(), 3);
  EXPECT_EQ(m.num_sessions(), 0);
}

TEST_F(SessionManagerTest, FullManagerReapsExpiredBeforeRefusing) {
  SessionManagerOptions o;
  o.max_sessions = 1;
  o.ttl = absl::Seconds(1);
  SessionManager m(o, clock_);
  ASSERT_TRUE(m.Add(NewSession()).ok());
  EXPECT_EQ(m.Add(NewSession()).status().code(),
            absl::StatusCode::kResourceExhausted);
  now_ += absl::Seconds(2);
  EXPECT_TRUE(m.Add(NewSession()).ok());
}

TEST_F(SessionManagerTest, LeasedSessionsAreNeverReapedAndReleaseWaits) {
  SessionManagerOptions o;
  o.ttl = absl::Seconds(1);
  int observed_sessions = -1;
  size_t observed_bytes = 0;
  SessionManager* observed = nullptr;
  SessionManager m(o, clock_, [&] {
    observed_sessions = observed->num_sessions();
    observed_bytes = model_->kv_cache().bytes_held();
  });
  observed = &m;
  // A session that has forwarded its prompt holds KV blocks.
  std::unique_ptr<DraftSession> fed = NewSession();
  ScoreOptions no_look_ahead;
  no_look_ahead.look_ahead = 0;
  ASSERT_TRUE(fed->Score({1, 5, 9}, no_look_ahead).ok());
  ASSERT_TRUE(fed->Draft({}, 1).ok());
  auto lease = m.Add(std::move(fed));
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(observed_sessions, 1);
  EXPECT_EQ(observed_bytes, Bytes(1));
  now_ += absl::Hours(1);
  EXPECT_EQ(m.Sweep(), 0);  // in use: not idle
  // Release while leased unlists it but keeps the memory until the lease
  // ends.
  DraftSession* s = lease->session();
  EXPECT_TRUE(m.Release(lease->id()));
  EXPECT_EQ(m.Acquire(lease->id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(lease->session(), s);
  EXPECT_EQ(m.num_sessions(), 1);
  lease->Reset();
  EXPECT_EQ(m.num_sessions(), 0);
  EXPECT_EQ(observed_sessions, 0);
  EXPECT_EQ(observed_bytes, 0u);  // the observer runs after the session died
}

// The router's ReleaseSession and the end of a cancelled Draft stream's
// lease race on two threads. The observer's calls must not overlap, so the
// last reports what is left: overlapping, a call that read 1 before the
// lease ended could set the gauge last, and it stayed at 1 with no session
// alive (seen once in the end-to-end cancel test under ASan).
TEST_F(SessionManagerTest, ObserverCallsNeverOverlapAndEndOnTheFinalState) {
  std::atomic<int> inside{0}, most{0}, observed{-1};
  SessionManager* manager = nullptr;
  SessionManager m({}, clock_, [&] {
    const int now_inside = inside.fetch_add(1) + 1;
    int seen = most.load();
    while (now_inside > seen && !most.compare_exchange_weak(seen, now_inside)) {
    }
    const int sessions = manager->num_sessions();
    absl::SleepFor(absl::Milliseconds(1));  // widens any overlap
    observed.store(sessions);
    inside.fetch_sub(1);
  });
  manager = &m;
  for (int i = 0; i < 40; ++i) {
    auto lease = m.Add(NewSession());
    ASSERT_TRUE(lease.ok());
    const std::string id = lease->id();
    std::atomic<bool> started{false};
    std::thread release([&] {
      started.store(true);
      m.Release(id);
    });
    while (!started.load()) std::this_thread::yield();
    lease->Reset();
    release.join();
    ASSERT_EQ(m.num_sessions(), 0);
    ASSERT_EQ(observed.load(), 0) << "iteration " << i;
  }
  EXPECT_EQ(most.load(), 1);
}

TEST_F(SessionManagerTest, MovedLeaseReturnsOnce) {
  SessionManager m({}, clock_);
  auto lease = m.Add(NewSession());
  ASSERT_TRUE(lease.ok());
  const std::string id = lease->id();
  SessionManager::Lease moved = *std::move(lease);
  EXPECT_FALSE(static_cast<bool>(*lease));
  EXPECT_EQ(m.Acquire(id).status().code(),
            absl::StatusCode::kFailedPrecondition);
  moved = SessionManager::Lease();
  EXPECT_TRUE(m.Acquire(id).ok());
}

}  // namespace
}  // namespace specserve
