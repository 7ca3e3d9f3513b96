#include "target_service/scheduler.h"

#include <random>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/engine/test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using testing_util::GreedyReference;
using testing_util::LoadBundled;

class TargetSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing_util::MakeCpuRunner(LoadBundled("stories260K"), 24);
    ASSERT_NE(model_, nullptr);
  }
  std::unique_ptr<TargetSession> Session(const std::vector<int>& prompt,
                                         int max_new) {
    TargetRequest r;
    r.token_ids = prompt;
    r.position_ids.resize(prompt.size());
    std::iota(r.position_ids.begin(), r.position_ids.end(), 0);
    r.stop.max_new_tokens = max_new;
    r.ignore_eos = true;
    auto s = TargetSession::Create(model_.get(), r);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  std::vector<int> RandomPrompt(int len, std::mt19937* rng) {
    std::vector<int> p = {1};
    for (int i = 1; i < len; ++i) p.push_back(3 + (*rng)() % 500);
    return p;
  }
  std::unique_ptr<CpuModelRunner> model_;
};

// A client of the scheduler: drives one session round by round with random
// drafts (each round submitted from the previous round's callback, like a
// Generate stream), until the session finishes.
struct Client {
  std::unique_ptr<TargetSession> session;
  std::mt19937 rng;
  absl::Notification done;
  absl::Status error;
  int rounds = 0;

  void Next(TargetScheduler* s) {
    std::vector<DraftToken> drafts(rng() % 5);
    for (auto& d : drafts) d.id = 3 + rng() % 500;
    // Every other round a token tree (random parents) instead of a chain.
    std::vector<int> parents;
    if (rng() % 2 == 0) {
      for (size_t i = 0; i < drafts.size(); ++i) {
        parents.push_back(static_cast<int>(rng() % (i + 1)) - 1);
      }
    }
    absl::Status st = s->Submit(
        session.get(), drafts, parents,
        [this, s](absl::StatusOr<RoundResult> r) {
          ++rounds;
          if (!r.ok()) {
            error = r.status();
            done.Notify();
          } else if (session->finished()) {
            done.Notify();
          } else {
            Next(s);
          }
        });
    if (!st.ok()) {
      error = st;
      done.Notify();
    }
  }
};

TEST_F(TargetSchedulerTest, ConcurrentSessionsAreBatchedAndEqualGreedy) {
  std::vector<TargetScheduler::StepStats> steps;
  absl::Mutex steps_mu;
  TargetScheduler::Options o;
  o.max_num_batched_tokens = 64;
  auto sched = TargetScheduler::Create(
      model_.get(), o, [&](const TargetScheduler::StepStats& st) {
        absl::MutexLock lock(&steps_mu);
        steps.push_back(st);
      });
  ASSERT_TRUE(sched.ok()) << sched.status();
  std::mt19937 rng(5);
  const int kClients = 12, kNew = 20;
  std::vector<std::vector<int>> prompts;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kClients; ++i) {
    prompts.push_back(RandomPrompt(5 + rng() % 90, &rng));
    auto c = std::make_unique<Client>();
    c->session = Session(prompts.back(), kNew);
    ASSERT_NE(c->session, nullptr);
    c->rng.seed(100 + i);
    clients.push_back(std::move(c));
  }
  for (auto& c : clients) c->Next(sched->get());
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(clients[i]->done.WaitForNotificationWithTimeout(
        absl::Seconds(60)));
    ASSERT_TRUE(clients[i]->error.ok()) << clients[i]->error;
    EXPECT_EQ(clients[i]->session->output(),
              GreedyReference(*model_, prompts[i], {},
                              static_cast<int>(prompts[i].size()), kNew))
        << i;
  }
  absl::MutexLock lock(&steps_mu);
  int max_seqs = 0, mixed = 0;
  for (const auto& st : steps) {
    EXPECT_LE(st.rows, 64);
    EXPECT_GE(st.sequences, 1);
    max_seqs = std::max(max_seqs, st.sequences);
    mixed += st.prefill_rows > 0 && st.prefill_rows < st.rows;
  }
  // Rounds of different sessions shared forwards, and prefill chunks rode
  // along with other sessions' decode / verify rows.
  EXPECT_GE(max_seqs, 4);
  EXPECT_GT(mixed, 0);
  // Far fewer forwards than rounds.
  int rounds = 0;
  for (auto& c : clients) rounds += c->rounds;
  EXPECT_LT(static_cast<int>(steps.size()), rounds / 2);
  EXPECT_EQ((*sched)->num_rounds(), 0);
}

// A long prompt is prefilled in budget-sized chunks while a streaming
// session keeps decoding: no forward exceeds the budget and the streaming
// session's rounds go first.
TEST_F(TargetSchedulerTest, ChunkedPrefillDoesNotStallDecoding) {
  std::vector<TargetScheduler::StepStats> steps;
  absl::Mutex steps_mu;
  TargetScheduler::Options o;
  o.max_num_batched_tokens = 16;
  auto sched = TargetScheduler::Create(
      model_.get(), o, [&](const TargetScheduler::StepStats& st) {
        absl::MutexLock lock(&steps_mu);
        steps.push_back(st);
      });
  ASSERT_TRUE(sched.ok());
  std::mt19937 rng(9);
  Client streaming;
  streaming.session = Session(RandomPrompt(6, &rng), 60);
  streaming.rng.seed(1);
  streaming.Next(sched->get());
  const std::vector<int> long_prompt = RandomPrompt(300, &rng);
  Client prefill;
  prefill.session = Session(long_prompt, 4);
  prefill.rng.seed(2);
  prefill.Next(sched->get());
  ASSERT_TRUE(prefill.done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(streaming.done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(prefill.error.ok()) << prefill.error;
  ASSERT_TRUE(streaming.error.ok()) << streaming.error;
  EXPECT_EQ(prefill.session->output(),
            GreedyReference(*model_, long_prompt, {}, 300, 4));
  absl::MutexLock lock(&steps_mu);
  int chunks = 0, shared = 0;
  for (const auto& st : steps) {
    EXPECT_LE(st.rows, 16);
    chunks += st.prefill_rows > 0;
    shared += st.prefill_rows > 0 && st.sequences > 1;
  }
  EXPECT_GE(chunks, 300 / 16);
  EXPECT_GT(shared, 0);
}

TEST_F(TargetSchedulerTest, RoundErrorsReachTheCallback) {
  auto sched = TargetScheduler::Create(model_.get(), {});
  ASSERT_TRUE(sched.ok());
  std::mt19937 rng(4);
  auto s = Session(RandomPrompt(8, &rng), 3);
  // A draft outside the vocabulary: INVALID_ARGUMENT, nothing cached.
  absl::Notification n1;
  absl::Status got;
  std::vector<DraftToken> bad(1);
  bad[0].id = 100000;
  ASSERT_TRUE((*sched)
                  ->Submit(s.get(), bad, {},
                           [&](absl::StatusOr<RoundResult> r) {
                             got = r.status();
                             n1.Notify();
                           })
                  .ok());
  ASSERT_TRUE(n1.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->kv_tokens(), 0);
  // Rounds until finished, then one more: FAILED_PRECONDITION.
  while (!s->finished()) {
    absl::Notification n;
    ASSERT_TRUE((*sched)
                    ->Submit(s.get(), {}, {},
                             [&](absl::StatusOr<RoundResult> r) {
                               got = r.status();
                               n.Notify();
                             })
                    .ok());
    ASSERT_TRUE(n.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(got.ok()) << got;
  }
  absl::Notification n2;
  ASSERT_TRUE((*sched)
                  ->Submit(s.get(), {}, {},
                           [&](absl::StatusOr<RoundResult> r) {
                             got = r.status();
                             n2.Notify();
                           })
                  .ok());
  ASSERT_TRUE(n2.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(TargetScheduler::Create(nullptr, {}).ok());
  TargetScheduler::Options zero;
  zero.max_num_batched_tokens = 0;
  EXPECT_EQ(TargetScheduler::Create(model_.get(), zero).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specserve
