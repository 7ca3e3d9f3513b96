// The scheduler's preemption policy over tracked sessions (moved here from
// the KV cache, which only allocates, frees, forks and truncates).

#include "common/scheduling/session_registry.h"

#include <memory>
#include <vector>

#include "common/util/clock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

// A session that only holds a sequence: preemption clears it and records
// the order.
class FakeSession final : public Session {
 public:
  FakeSession(std::unique_ptr<KvSequence> kv, int index,
              std::vector<int>* preempted)
      : kv_(std::move(kv)), index_(index), preempted_(preempted) {}
  ~FakeSession() override { StopPreemption(); }
  KvSequence* kv() { return kv_.get(); }
  int pending_rows() const override { return 0; }
  int min_forward_rows() const override { return 1; }
  bool prefilling() const override { return false; }
  absl::Status PlanForward(int, SequenceForward*) override {
    return absl::FailedPreconditionError("no operation");
  }
  absl::Status CompleteForward(const ForwardOutput&) override {
    return absl::FailedPreconditionError("no operation");
  }
  void Abort() override {}
  void Preempt() override {
    if (preempted_ != nullptr) preempted_->push_back(index_);
    ++num_preemptions_;
    kv_->Clear();
  }
  int num_preemptions() const override { return num_preemptions_; }
  const KvSequence* kv_sequence() const override { return kv_.get(); }

 private:
  std::unique_ptr<KvSequence> kv_;
  int index_;
  std::vector<int>* preempted_;
  int num_preemptions_ = 0;
};

// Preemption by recomputation: newest first, only tracked sessions newer
// than the caller that hold blocks, until enough are free.
TEST(SessionRegistryTest, PreemptNewestFreesNewestSessionsFirst) {
  PagedKvCache cache(8, 4, /*bytes_per_token=*/10, nullptr);
  SessionRegistry registry;
  std::vector<std::unique_ptr<FakeSession>> sessions;
  std::vector<int> preempted;
  for (int i = 0; i < 4; ++i) {
    sessions.push_back(
        std::make_unique<FakeSession>(cache.NewSequence(32), i, &preempted));
    ASSERT_TRUE(sessions.back()->kv()->Reserve(8).ok());  // pool full
    registry.Track(sessions.back().get());
  }
  EXPECT_EQ(registry.size(), 4);
  EXPECT_EQ(cache.num_free_blocks(), 0);

  // The oldest asks for 3 blocks: the two newest go, newest first.
  auto victims = registry.PreemptNewest(cache, 3, sessions[0]->kv()->id());
  ASSERT_EQ(victims.size(), 2u);
  EXPECT_EQ(victims[0], sessions[3]->kv());
  EXPECT_EQ(victims[1], sessions[2]->kv());
  EXPECT_EQ(preempted, std::vector<int>({3, 2}));
  EXPECT_EQ(cache.num_available_blocks(), 4);
  EXPECT_EQ(sessions[3]->kv()->size(), 0);
  EXPECT_TRUE(sessions[0]->kv()->Reserve(9).ok());  // 3 more blocks

  // Nothing newer than the newest: no victims, even when short.
  EXPECT_TRUE(
      registry.PreemptNewest(cache, 8, sessions[3]->kv()->id()).empty());
  // A session that stopped preemption (as its destructor does first) is
  // never preempted.
  sessions[1].reset();
  EXPECT_EQ(registry.size(), 3);
  EXPECT_TRUE(
      registry.PreemptNewest(cache, 8, sessions[0]->kv()->id()).empty());
}

// Idle sessions (sequence not in `busy`, unused since the given time) are
// preempted least recently used first, of any age; busy ones, recently
// used ones and untracked ones never.
TEST(SessionRegistryTest, PreemptIdleTakesLeastRecentlyUsedIdleSessions) {
  PagedKvCache cache(8, 4, /*bytes_per_token=*/10, nullptr);
  SessionRegistry registry;
  std::vector<std::unique_ptr<FakeSession>> sessions;
  const int64_t before = MonotonicNowNs();
  for (int i = 0; i < 4; ++i) {
    sessions.push_back(
        std::make_unique<FakeSession>(cache.NewSequence(32), i, nullptr));
    ASSERT_TRUE(sessions.back()->kv()->Reserve(8).ok());
    if (i < 3) registry.Track(sessions.back().get());  // 3 is untracked
  }
  absl::flat_hash_set<const KvSequence*> busy = {sessions[2]->kv()};
  // Used after `before`: not idle long enough.
  EXPECT_TRUE(registry.PreemptIdle(cache, 2, busy, before).empty());
  ASSERT_TRUE(sessions[0]->kv()->Truncate(8).ok());
  ASSERT_TRUE(sessions[1]->kv()->Reserve(0).ok());  // sessions[1] used last
  const int64_t now = MonotonicNowNs() + 1;
  auto v = registry.PreemptIdle(cache, 2, busy, now);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0], sessions[0]->kv());  // least recently used
  EXPECT_EQ(sessions[2]->kv()->size(), 8);
  v = registry.PreemptIdle(cache, 6, busy, now);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0], sessions[1]->kv());
  EXPECT_EQ(cache.num_available_blocks(), 4);
  EXPECT_TRUE(registry.PreemptIdle(cache, 6, busy, now).empty());
  EXPECT_EQ(sessions[3]->kv()->size(), 8);  // untracked: kept
}

// Sessions may outlive their registry (a service's scheduler stops before
// its sessions are freed).
TEST(SessionRegistryTest, SessionsOutliveTheRegistry) {
  PagedKvCache cache(4, 4, /*bytes_per_token=*/10, nullptr);
  auto s = std::make_unique<FakeSession>(cache.NewSequence(8), 0, nullptr);
  {
    SessionRegistry registry;
    registry.Track(s.get());
    registry.Track(s.get());  // idempotent
    EXPECT_EQ(registry.size(), 1);
  }
  s.reset();  // no use of the destroyed registry (ASan)
}

}  // namespace
}  // namespace specserve
