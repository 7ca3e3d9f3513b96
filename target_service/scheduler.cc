#include "target_service/scheduler.h"

#include <chrono>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TargetScheduler>> TargetScheduler::Create(
    ModelRunner* model, Options options, StepObserver on_step) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("TargetScheduler: model is null");
  }
  if (options.max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_batched_tokens must be >= 1, got ",
                     options.max_num_batched_tokens));
  }
  return std::unique_ptr<TargetScheduler>(
      new TargetScheduler(model, options, std::move(on_step)));
}

TargetScheduler::TargetScheduler(ModelRunner* model, Options options,
                                 StepObserver on_step)
    : model_(model), options_(options), on_step_(std::move(on_step)) {
  thread_ = std::thread([this] { Loop(); });
}

TargetScheduler::~TargetScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::Status TargetScheduler::Submit(TargetSession* session,
                                     std::vector<DraftToken> drafts,
                                     Done done) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError("the scheduler is shutting down");
  auto r = std::make_unique<Round>();
  r->session = session;
  r->drafts = std::move(drafts);
  r->done = std::move(done);
  incoming_.push_back(std::move(r));
  ++in_flight_;
  return absl::OkStatus();
}

int TargetScheduler::num_rounds() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

void TargetScheduler::Loop() {
  std::vector<std::unique_ptr<Round>> rounds;  // in flight, FIFO
  std::vector<std::pair<Done, absl::StatusOr<RoundResult>>> finished;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Idle: sleep until a round arrives (or shutdown).
      if (rounds.empty()) {
        mu_.Await(absl::Condition(
            +[](TargetScheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
              return s->stop_ || !s->incoming_.empty();
            },
            this));
      }
      if (stop_) break;
      while (!incoming_.empty()) {
        rounds.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
    }
    Step(&rounds, &finished);
    if (!finished.empty()) {
      {
        absl::MutexLock lock(&mu_);
        in_flight_ -= static_cast<int>(finished.size());
      }
      for (auto& [done, result] : finished) done(std::move(result));
      finished.clear();
    }
  }
  // Shutting down: nothing more runs.
  std::vector<Done> cancelled;
  {
    absl::MutexLock lock(&mu_);
    for (auto& r : incoming_) rounds.push_back(std::move(r));
    incoming_.clear();
    in_flight_ = 0;
  }
  for (auto& r : rounds) {
    if (r->begun) r->session->AbortRound();
    r->done(absl::CancelledError("the target is shutting down"));
  }
}

void TargetScheduler::Step(
    std::vector<std::unique_ptr<Round>>* rounds,
    std::vector<std::pair<Done, absl::StatusOr<RoundResult>>>* out) {
  // Start new rounds; a round that cannot start ends here.
  for (auto it = rounds->begin(); it != rounds->end();) {
    Round& r = **it;
    if (!r.begun) {
      if (absl::Status s = r.session->BeginRound(r.drafts); !s.ok()) {
        out->emplace_back(std::move(r.done), s);
        it = rounds->erase(it);
        continue;
      }
      r.begun = true;
    }
    ++it;
  }
  // Pack the budget: decode / verify rounds first, then prefill chunks.
  int budget = options_.max_num_batched_tokens;
  std::vector<SequenceForward> batch;
  std::vector<Round*> planned;
  StepStats stats;
  for (bool prefill_pass : {false, true}) {
    for (auto& rp : *rounds) {
      TargetSession& s = *rp->session;
      if (s.prefilling() != prefill_pass) continue;
      const int need = s.min_forward_rows();
      if (need > budget) continue;
      SequenceForward e;
      const int rows = std::min(budget, s.pending_rows());
      if (absl::Status st = s.PlanForward(rows, &e); !st.ok()) continue;
      const int n = static_cast<int>(e.input.token_ids.size());
      budget -= n;
      stats.rows += n;
      if (prefill_pass) stats.prefill_rows += n;
      batch.push_back(std::move(e));
      planned.push_back(rp.get());
    }
  }
  if (batch.empty()) {
    // Every round needs more rows than the whole budget: fail them rather
    // than spin (Options are validated against max_drafts by the server).
    for (auto& rp : *rounds) {
      rp->session->AbortRound();
      out->emplace_back(std::move(rp->done),
                        absl::ResourceExhaustedError(absl::StrCat(
                            "a round needs ", rp->session->min_forward_rows(),
                            " rows, more than max_num_batched_tokens ",
                            options_.max_num_batched_tokens)));
    }
    rounds->clear();
    return;
  }
  std::vector<ForwardOutput> outs;
  const int64_t t0 = NowNs();
  const absl::Status fs = model_->Forward(batch, &outs);
  stats.forward_ns = NowNs() - t0;
  stats.sequences = static_cast<int>(batch.size());
  if (on_step_) on_step_(stats);
  // Hand each round its rows; collect the rounds that ended.
  absl::flat_hash_set<Round*> ended;
  for (size_t i = 0; i < planned.size(); ++i) {
    Round& r = *planned[i];
    if (!fs.ok()) {
      r.session->AbortRound();
      out->emplace_back(std::move(r.done), fs);
      ended.insert(&r);
      continue;
    }
    absl::StatusOr<std::optional<RoundResult>> res =
        r.session->CompleteForward(outs[i]);
    if (!res.ok()) {
      out->emplace_back(std::move(r.done), res.status());
      ended.insert(&r);
    } else if (res->has_value()) {
      out->emplace_back(std::move(r.done), **std::move(res));
      ended.insert(&r);
    }
  }
  if (!ended.empty()) {
    std::vector<std::unique_ptr<Round>> keep;
    for (auto& rp : *rounds) {
      if (!ended.contains(rp.get())) keep.push_back(std::move(rp));
    }
    rounds->swap(keep);
  }
}

}  // namespace specserve
