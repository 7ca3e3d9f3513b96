#include "common/scheduling/batch_scheduler.h"

#include <memory>
#include <string>
#include <random>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/speculation/draft_session.h"
#include "common/scheduling/session_work.h"
#include "common/engine/test_util.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using testing_util::LoadBundled;

// A work that needs `rows` rows in one forward it never gets.
class TooWideWork : public BatchedWork {
 public:
  TooWideWork(int rows, absl::Status* out, absl::Notification* n)
      : rows_(rows), out_(out), n_(n) {}
  absl::Status Begin() override { return absl::OkStatus(); }
  int pending_rows() const override { return rows_; }
  int min_forward_rows() const override { return rows_; }
  bool prefilling() const override { return false; }
  absl::Status PlanForward(int, SequenceForward*) override {
    return absl::InternalError("never planned");
  }
  absl::Status CompleteForward(const ForwardOutput&) override {
    return absl::InternalError("never run");
  }
  void Abort() override {}
  void Finish(absl::Status s) override {
    *out_ = s;
    n_->Notify();
  }

 private:
  int rows_;
  absl::Status* out_;
  absl::Notification* n_;
};

class BatchSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing_util::MakeCpuRunner(LoadBundled("stories260K-draft"), 24);
    ASSERT_NE(model_, nullptr);
  }
  std::vector<int> Prompt(int len, std::mt19937* rng) {
    std::vector<int> p = {1};
    for (int i = 1; i < len; ++i) p.push_back(3 + (*rng)() % 500);
    return p;
  }
  std::unique_ptr<CpuModelRunner> model_;
};

// Speculative Prefill scoring and drafting of many sessions through one
// scheduler (prompts chunked by a small budget, forwards shared) give what
// each session's own Score() and Draft() give.
TEST_F(BatchSchedulerTest, BatchedScoreAndDraftEqualSequential) {
  std::vector<BatchScheduler::StepStats> steps;
  absl::Mutex mu;
  BatchScheduler::Options o;
  o.max_num_batched_tokens = 24;
  auto sched = BatchScheduler::Create(
      model_.get(), o, [&](const BatchScheduler::StepStats& st) {
        absl::MutexLock lock(&mu);
        steps.push_back(st);
      });
  ASSERT_TRUE(sched.ok()) << sched.status();
  std::mt19937 rng(2);
  ScoreOptions so;
  so.look_ahead = 4;
  so.selection.chunk_size = 4;
  so.selection.keep_ratio = 0.3;
  const int kSessions = 8;
  std::vector<std::vector<int>> prompts;
  std::vector<ScoreResult> want_score;
  std::vector<std::vector<DraftToken>> want_drafts;
  std::vector<int> emitted = {7, 9};
  for (int i = 0; i < kSessions; ++i) {
    prompts.push_back(Prompt(10 + rng() % 80, &rng));
    auto s = DraftSession::Create(model_.get(), 512, SamplingParams{});
    ASSERT_TRUE(s.ok());
    auto r = (*s)->Score(prompts.back(), so);
    ASSERT_TRUE(r.ok()) << r.status();
    want_score.push_back(*r);
    auto d = (*s)->Draft(emitted, 5);
    ASSERT_TRUE(d.ok()) << d.status();
    want_drafts.push_back(*d);
  }
  std::vector<std::unique_ptr<DraftSession>> sessions;
  std::vector<absl::StatusOr<ScoreResult>> got_score(
      kSessions, absl::UnknownError("not run"));
  std::vector<std::vector<DraftToken>> got_drafts(kSessions);
  std::vector<absl::Notification> scored(kSessions), drafted(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    auto s = DraftSession::Create(model_.get(), 512, SamplingParams{});
    ASSERT_TRUE(s.ok());
    sessions.push_back(*std::move(s));
  }
  // The first work of each phase holds the scheduler until every work is
  // submitted, so that sharing does not depend on thread timing.
  absl::Notification all_scores_in, all_drafts_in;
  for (int i = 0; i < kSessions; ++i) {
    DraftSession* s = sessions[i].get();
    ASSERT_TRUE((*sched)
                    ->Submit(std::make_unique<SessionWork>(
                        s, [s, &prompts, i, so, &all_scores_in] {
                          if (i == 0) all_scores_in.WaitForNotification();
                          return s->BeginScore(prompts[i], so);
                        },
                        [&, s, i](absl::Status st) {
                          got_score[i] =
                              st.ok() ? s->TakeScoreResult()
                                      : absl::StatusOr<ScoreResult>(st);
                          scored[i].Notify();
                        }))
                    .ok());
  }
  all_scores_in.Notify();
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE(scored[i].WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_TRUE(got_score[i].ok()) << got_score[i].status();
    EXPECT_EQ(got_score[i]->look_ahead_tokens, want_score[i].look_ahead_tokens);
    EXPECT_EQ(got_score[i]->selection.kept_indices,
              want_score[i].selection.kept_indices);
    ASSERT_EQ(got_score[i]->importance.size(), want_score[i].importance.size());
    for (size_t t = 0; t < want_score[i].importance.size(); ++t) {
      ASSERT_NEAR(got_score[i]->importance[t], want_score[i].importance[t],
                  1e-6);
    }
  }
  for (int i = 0; i < kSessions; ++i) {
    DraftSession* s = sessions[i].get();
    ASSERT_TRUE((*sched)
                    ->Submit(std::make_unique<SessionWork>(
                        s,
                        [s, &emitted, i, &all_drafts_in] {
                          if (i == 0) all_drafts_in.WaitForNotification();
                          return s->BeginDraft(emitted, 5);
                        },
                        [&, s, i](absl::Status st) {
                          EXPECT_TRUE(st.ok()) << st;
                          got_drafts[i] = s->TakeDrafts();
                          drafted[i].Notify();
                        }))
                    .ok());
  }
  all_drafts_in.Notify();
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE(drafted[i].WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_EQ(got_drafts[i].size(), want_drafts[i].size());
    for (size_t j = 0; j < want_drafts[i].size(); ++j) {
      EXPECT_EQ(got_drafts[i][j].id, want_drafts[i][j].id) << i << " " << j;
    }
  }
  absl::MutexLock lock(&mu);
  int shared = 0, chunks_with_decode = 0;
  for (const auto& st : steps) {
    EXPECT_LE(st.rows, 24);
    shared += st.sequences > 1;
    chunks_with_decode += st.prefill_rows > 0 && st.prefill_rows < st.rows;
  }
  EXPECT_GT(shared, 0);
  EXPECT_GT(chunks_with_decode, 0);
  EXPECT_EQ((*sched)->num_works(), 0);
}

// Under KV pressure (a pool of one 512-token sequence for 8 sessions that
// keep their caches), older sessions preempt newer ones, which recompute
// their prompt and drafts later: every Score and Draft still equals the
// session's own sequential run, and preemptions happened.
TEST_F(BatchSchedulerTest, PreemptedSessionsRecomputeAndMatchSequential) {
  auto small = testing_util::MakeCpuRunner(LoadBundled("stories260K-draft"), 1);
  ASSERT_NE(small, nullptr);
  absl::Mutex mu;
  int preempted = 0;
  BatchScheduler::Options o;
  o.max_num_batched_tokens = 64;
  auto sched = BatchScheduler::Create(
      small.get(), o, [&](const BatchScheduler::StepStats& st) {
        absl::MutexLock lock(&mu);
        preempted += st.preempted;
      });
  ASSERT_TRUE(sched.ok()) << sched.status();
  std::mt19937 rng(5);
  ScoreOptions so;
  so.look_ahead = 4;
  so.selection.chunk_size = 4;
  const int kSessions = 8;
  const std::vector<int> emitted = {7, 9, 11};
  std::vector<std::vector<int>> prompts;
  std::vector<ScoreResult> want_score;
  std::vector<std::vector<DraftToken>> want_drafts;
  for (int i = 0; i < kSessions; ++i) {
    prompts.push_back(Prompt(80 + rng() % 60, &rng));
    auto s = DraftSession::Create(model_.get(), 512, SamplingParams{});
    ASSERT_TRUE(s.ok());
    auto r = (*s)->Score(prompts.back(), so);
    ASSERT_TRUE(r.ok()) << r.status();
    want_score.push_back(*r);
    auto d = (*s)->Draft(emitted, 6);
    ASSERT_TRUE(d.ok()) << d.status();
    want_drafts.push_back(*d);
  }
  std::vector<std::unique_ptr<DraftSession>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    auto s = DraftSession::Create(small.get(), 512, SamplingParams{});
    ASSERT_TRUE(s.ok());
    sessions.push_back(*std::move(s));
  }
  // Score all (their caches stay), then draft all: 8 x ~110 tokens do not
  // fit 512 slots.
  for (int phase = 0; phase < 2; ++phase) {
    std::vector<absl::Status> got(kSessions, absl::UnknownError("not run"));
    std::vector<absl::Notification> done(kSessions);
    // Results are taken in Finish, on the scheduler's thread, as the
    // services do: an idle session may be preempted there at any time.
    std::vector<absl::StatusOr<ScoreResult>> scores(
        kSessions, absl::UnknownError("not run"));
    std::vector<std::vector<DraftToken>> drafts(kSessions);
    for (int i = 0; i < kSessions; ++i) {
      DraftSession* s = sessions[i].get();
      auto begin = [s, &prompts, &emitted, i, so, phase] {
        return phase == 0 ? s->BeginScore(prompts[i], so)
                          : s->BeginDraft(emitted, 6);
      };
      ASSERT_TRUE((*sched)
                      ->Submit(std::make_unique<SessionWork>(
                          s, begin,
                          [&, s, i, phase](absl::Status st) {
                            got[i] = st;
                            if (st.ok() && phase == 0) {
                              scores[i] = s->TakeScoreResult();
                            } else if (st.ok()) {
                              drafts[i] = s->TakeDrafts();
                            }
                            done[i].Notify();
                          }))
                      .ok());
    }
    for (int i = 0; i < kSessions; ++i) {
      ASSERT_TRUE(done[i].WaitForNotificationWithTimeout(absl::Seconds(60)));
      ASSERT_TRUE(got[i].ok()) << i << ": " << got[i];
      if (phase == 0) {
        const absl::StatusOr<ScoreResult>& r = scores[i];
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->look_ahead_tokens, want_score[i].look_ahead_tokens) << i;
        EXPECT_EQ(r->selection.kept_indices,
                  want_score[i].selection.kept_indices)
            << i;
      } else {
        const std::vector<DraftToken>& d = drafts[i];
        ASSERT_EQ(d.size(), want_drafts[i].size()) << i;
        for (size_t j = 0; j < d.size(); ++j) {
          EXPECT_EQ(d[j].id, want_drafts[i][j].id) << i << " " << j;
        }
      }
    }
  }
  absl::MutexLock lock(&mu);
  EXPECT_GT(preempted, 0);
  // The scheduler is idle now: the sessions' counters are safe to read.
  EXPECT_EQ((*sched)->num_works(), 0);
  int recomputed = 0;
  for (const auto& s : sessions) recomputed += s->num_preemptions();
  EXPECT_EQ(recomputed, preempted);
}

TEST_F(BatchSchedulerTest, ImpossibleAndFailingWorkEndWithErrors) {
  BatchScheduler::Options o;
  o.max_num_batched_tokens = 8;
  auto sched = BatchScheduler::Create(model_.get(), o);
  ASSERT_TRUE(sched.ok());
  absl::Status got;
  absl::Notification n;
  ASSERT_TRUE((*sched)->Submit(std::make_unique<TooWideWork>(9, &got, &n)).ok());
  ASSERT_TRUE(n.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.code(), absl::StatusCode::kResourceExhausted);
  // A Begin error (a Draft before any prompt) reaches Finish.
  auto s = DraftSession::Create(model_.get(), 64, SamplingParams{});
  ASSERT_TRUE(s.ok());
  DraftSession* ds = s->get();
  absl::Notification n2;
  ASSERT_TRUE((*sched)
                  ->Submit(std::make_unique<SessionWork>(
                      ds, [ds] { return ds->BeginDraft({5}, 2); },
                      [&](absl::Status st) {
                        got = st;
                        n2.Notify();
                      }))
                  .ok());
  ASSERT_TRUE(n2.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(BatchScheduler::Create(nullptr, {}).ok());
}

// A work whose sequence holds no blocks and whose first forward needs the
// whole pool (a preempted request near its full length recomputing in one
// chunk) starts once every block is free: the watermark keeps headroom for
// running requests, it must not make a request that fits the pool wait
// forever. Regression: it waited for pool + watermark blocks, a hang.
TEST_F(BatchSchedulerTest, AWorkNeedingTheWholePoolStartsWhenItIsFree) {
  auto small = testing_util::MakeCpuRunner(LoadBundled("stories260K-draft"), 1);
  ASSERT_NE(small, nullptr);
  const PagedKvCache& cache = small->kv_cache();
  BatchScheduler::Options o;
  o.max_num_batched_tokens = 4096;  // the whole prompt in one forward
  o.kv_watermark = 0.05;
  auto sched = BatchScheduler::Create(small.get(), o);
  ASSERT_TRUE(sched.ok()) << sched.status();
  ScoreOptions so;
  so.look_ahead = 4;
  so.selection.chunk_size = 4;
  std::mt19937 rng(11);
  // Prompt and look-ahead fill every block of the pool, the last one only
  // partly; the prompt alone (the first forward) already needs every block.
  ASSERT_GT(cache.block_size(), so.look_ahead + 1);
  const int tokens = cache.num_blocks() * cache.block_size() - 1;
  const std::vector<int> prompt = Prompt(tokens - so.look_ahead, &rng);
  auto s = DraftSession::Create(small.get(), tokens, SamplingParams{});
  ASSERT_TRUE(s.ok()) << s.status();
  DraftSession* ds = s->get();
  absl::Status got = absl::UnknownError("not run");
  absl::Notification done;
  ASSERT_TRUE((*sched)
                  ->Submit(std::make_unique<SessionWork>(
                      ds, [ds, &prompt, so] { return ds->BeginScore(prompt, so); },
                      [&](absl::Status st) {
                        got = st;
                        done.Notify();
                      }))
                  .ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)))
      << "a work that fits the pool never started";
  EXPECT_TRUE(got.ok()) << got;
  EXPECT_EQ(ds->kv_tokens(), tokens);
}

// Works still in flight when the scheduler goes away end with CANCELLED
// and leave their caches as they were.
// A work that holds the loop in Begin until released, then needs no
// forward.
class BlockingWork : public BatchedWork {
 public:
  BlockingWork(absl::Notification* begun, absl::Notification* release)
      : begun_(begun), release_(release) {}
  absl::Status Begin() override {
    begun_->Notify();
    release_->WaitForNotification();
    return absl::OkStatus();
  }
  int pending_rows() const override { return 0; }
  int min_forward_rows() const override { return 1; }
  bool prefilling() const override { return false; }
  absl::Status PlanForward(int, SequenceForward*) override {
    return absl::InternalError("no rows");
  }
  absl::Status CompleteForward(const ForwardOutput&) override {
    return absl::InternalError("no rows");
  }
  void Abort() override {}
  void Finish(absl::Status) override {}

 private:
  absl::Notification* begun_;
  absl::Notification* release_;
};

// `steps` forwards of one token each on its own sequence; records when it
// finished.
class StepsWork : public BatchedWork {
 public:
  StepsWork(ModelRunner* model, int steps, absl::Time* done,
            absl::Notification* n)
      : model_(model), steps_(steps), done_(done), n_(n) {}
  absl::Status Begin() override {
    auto kv = model_->NewSequence(64);
    if (!kv.ok()) return kv.status();
    kv_ = *std::move(kv);
    return absl::OkStatus();
  }
  int pending_rows() const override { return steps_ > 0 ? 1 : 0; }
  int min_forward_rows() const override { return 1; }
  bool prefilling() const override { return false; }
  absl::Status PlanForward(int, SequenceForward* entry) override {
    pos_ = kv_->size();
    entry->kv = kv_.get();
    entry->input.token_ids = absl::MakeConstSpan(&token_, 1);
    entry->input.position_ids = absl::MakeConstSpan(&pos_, 1);
    return absl::OkStatus();
  }
  absl::Status CompleteForward(const ForwardOutput&) override {
    --steps_;
    return absl::OkStatus();
  }
  void Abort() override {}
  void Finish(absl::Status) override {
    *done_ = absl::Now();
    n_->Notify();
  }
  const KvSequence* sequence() const override { return kv_.get(); }

 private:
  ModelRunner* model_;
  int steps_;
  absl::Time* done_;
  absl::Notification* n_;
  std::unique_ptr<KvSequence> kv_;
  int token_ = 5, pos_ = 0;
};

// max_batch_wait waits for the previous step's works only when all of them
// ended: a work with forwards still to go (a draft's next depth) runs on
// at once although a work it shared a step with has not come back.
TEST_F(BatchSchedulerTest, WorkInFlightDoesNotWaitForEndedOnes) {
  BatchScheduler::Options o;
  o.max_batch_wait = absl::Seconds(2);
  auto sched = BatchScheduler::Create(model_.get(), o);
  ASSERT_TRUE(sched.ok()) << sched.status();
  absl::Time short_done, long_done;
  absl::Notification short_n, long_n;
  const absl::Time start = absl::Now();
  // Queued together (the loop sleeps until the first arrives, so submit
  // the long one second: both are usually in the first step; either way
  // the long one outlives the short one by 5 forwards).
  ASSERT_TRUE((*sched)
                  ->Submit(std::make_unique<StepsWork>(model_.get(), 1,
                                                       &short_done, &short_n))
                  .ok());
  ASSERT_TRUE((*sched)
                  ->Submit(std::make_unique<StepsWork>(model_.get(), 6,
                                                       &long_done, &long_n))
                  .ok());
  short_n.WaitForNotification();
  long_n.WaitForNotification();
  // Six forwards of one row on the 260K-parameter model take well under a
  // second; one 2-second wait per forward would take 10.
  EXPECT_LT(long_done - start, absl::Seconds(1.5));
  // And a lone stream's next round still waits for nothing it need not:
  // the previous step's one work ended, one arrives, no wait.
  absl::Time again_done;
  absl::Notification again_n;
  const absl::Time again = absl::Now();
  ASSERT_TRUE((*sched)
                  ->Submit(std::make_unique<StepsWork>(model_.get(), 1,
                                                       &again_done, &again_n))
                  .ok());
  again_n.WaitForNotification();
  EXPECT_LT(again_done - again, absl::Seconds(1.5));
}

// StepsWork whose every CompleteForward takes `host` of host time, as a
// round's bookkeeping on the loop thread would.
class SlowStepsWork : public StepsWork {
 public:
  SlowStepsWork(ModelRunner* model, int steps, absl::Duration host,
                absl::Time* done, absl::Notification* n)
      : StepsWork(model, steps, done, n), host_(host) {}
  absl::Status CompleteForward(const ForwardOutput& out) override {
    absl::SleepFor(host_);
    return StepsWork::CompleteForward(out);
  }

 private:
  absl::Duration host_;
};

// StepStats::gap_ns is the host time between two back-to-back forwards
// (what the target's step_gap_seconds reports): at least the works' host
// time between busy steps, never the forward itself, and not the time the
// loop slept with nothing to do (0 before the first forward ever).
TEST_F(BatchSchedulerTest, StepGapIsTheHostTimeBetweenForwards) {
  absl::Mutex mu;
  std::vector<BatchScheduler::StepStats> steps;
  auto sched = BatchScheduler::Create(
      model_.get(), BatchScheduler::Options{},
      [&](const BatchScheduler::StepStats& st) {
        absl::MutexLock lock(&mu);
        if (st.sequences > 0) steps.push_back(st);
      });
  ASSERT_TRUE(sched.ok()) << sched.status();
  constexpr absl::Duration kHost = absl::Milliseconds(30);
  for (int round = 0; round < 2; ++round) {  // two busy periods, idle between
    absl::Time done;
    absl::Notification n;
    ASSERT_TRUE((*sched)
                    ->Submit(std::make_unique<SlowStepsWork>(
                        model_.get(), 4, kHost, &done, &n))
                    .ok());
    n.WaitForNotification();
    absl::SleepFor(absl::Milliseconds(50));  // the loop goes idle
  }
  absl::MutexLock lock(&mu);
  ASSERT_EQ(steps.size(), 8u);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_GT(steps[i].forward_ns, 0);
    if (i == 0) {
      EXPECT_EQ(steps[i].gap_ns, 0);
    } else if (i % 4 == 0) {  // after the last work's host time and 50 ms idle
      EXPECT_GE(steps[i].gap_ns, absl::ToInt64Nanoseconds(kHost));
      EXPECT_LT(steps[i].gap_ns, absl::ToInt64Nanoseconds(kHost) +
                                     absl::ToInt64Nanoseconds(
                                         absl::Milliseconds(40)));
    } else {
      EXPECT_GE(steps[i].gap_ns, absl::ToInt64Nanoseconds(kHost));
      EXPECT_LT(steps[i].gap_ns, absl::ToInt64Nanoseconds(10 * kHost));
    }
  }
}

// max_works (the speculator's --max_queue) refuses work past the limit of
// works queued or running, and accepts again once they end.
TEST_F(BatchSchedulerTest, MaxWorksRefusesPastTheLimit) {
  BatchScheduler::Options o;
  o.max_works = 1;
  auto sched = BatchScheduler::Create(model_.get(), o);
  ASSERT_TRUE(sched.ok()) << sched.status();
  absl::Notification begun, release, begun2, release2;
  ASSERT_TRUE(
      (*sched)->Submit(std::make_unique<BlockingWork>(&begun, &release)).ok());
  begun.WaitForNotification();
  const absl::Status full =
      (*sched)->Submit(std::make_unique<BlockingWork>(&begun2, &release2));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("max_queue"), std::string::npos) << full;
  release.Notify();
  for (int i = 0; i < 5000 && (*sched)->num_works() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ((*sched)->num_works(), 0);
  release2.Notify();
  EXPECT_TRUE(
      (*sched)->Submit(std::make_unique<BlockingWork>(&begun2, &release2))
          .ok());
}

TEST_F(BatchSchedulerTest, ShutdownCancelsWorkInFlight) {
  std::mt19937 rng(8);
  std::vector<std::unique_ptr<DraftSession>> sessions;
  std::vector<absl::Status> got(16);
  int finished = 0;
  {
    BatchScheduler::Options o;
    o.max_num_batched_tokens = 1;  // one row per step: slow on purpose
    auto sched = BatchScheduler::Create(model_.get(), o);
    ASSERT_TRUE(sched.ok());
    ScoreOptions so;
    for (int i = 0; i < 16; ++i) {
      auto s = DraftSession::Create(model_.get(), 512, SamplingParams{});
      ASSERT_TRUE(s.ok());
      DraftSession* ds = s->get();
      sessions.push_back(*std::move(s));
      const std::vector<int> p = Prompt(200, &rng);
      ASSERT_TRUE((*sched)
                      ->Submit(std::make_unique<SessionWork>(
                          ds, [ds, p, so] { return ds->BeginScore(p, so); },
                          [&, i](absl::Status st) {
                            got[i] = st;
                            ++finished;
                          }))
                      .ok());
    }
  }  // destroyed with most scoring still to do
  EXPECT_EQ(finished, 16);
  int cancelled = 0;
  for (int i = 0; i < 16; ++i) {
    if (got[i].code() == absl::StatusCode::kCancelled) {
      ++cancelled;
      EXPECT_EQ(sessions[i]->kv_tokens(), 0);
    }
  }
  EXPECT_GT(cancelled, 0);
}

}  // namespace
}  // namespace specserve
