#include "common/scheduling/batch_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/util/clock.h"

namespace specserve {

absl::StatusOr<std::unique_ptr<BatchScheduler>> BatchScheduler::Create(
    ModelRunner* model, Options options, StepObserver on_step) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("BatchScheduler: model is null");
  }
  if (options.max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_batched_tokens must be >= 1, got ",
                     options.max_num_batched_tokens));
  }
  return std::unique_ptr<BatchScheduler>(
      new BatchScheduler(model, options, std::move(on_step)));
}

BatchScheduler::BatchScheduler(ModelRunner* model, Options options,
                               StepObserver on_step)
    : model_(model), options_(options), on_step_(std::move(on_step)) {
  thread_ = std::thread([this] { Loop(); });
}

BatchScheduler::~BatchScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::Status BatchScheduler::Submit(std::unique_ptr<BatchedWork> work) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError("the scheduler is shutting down");
  incoming_.push_back(std::move(work));
  ++in_flight_;
  return absl::OkStatus();
}

int BatchScheduler::num_works() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

void BatchScheduler::Loop() {
  std::vector<Entry> works;  // in flight, FIFO
  Ended ended;
  int last_sequences = 0;  // works in the previous step's forward
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Idle: sleep until work arrives (or shutdown).
      if (works.empty()) {
        mu_.Await(absl::Condition(
            +[](BatchScheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
              return s->stop_ || !s->incoming_.empty();
            },
            this));
      }
      // Give the previous step's requests a moment to send their next
      // work, so that they share this step instead of the next one.
      const size_t want = static_cast<size_t>(last_sequences);
      if (!stop_ && works.size() + incoming_.size() < want &&
          options_.max_batch_wait > absl::ZeroDuration()) {
        struct Arg {
          BatchScheduler* s;
          size_t need;
        } arg{this, want - std::min(want, works.size())};
        mu_.AwaitWithTimeout(
            absl::Condition(
                +[](Arg* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->s->mu_) {
                  return a->s->stop_ || a->s->incoming_.size() >= a->need;
                },
                &arg),
            options_.max_batch_wait);
      }
      if (stop_) break;
      while (!incoming_.empty()) {
        works.push_back(Entry{std::move(incoming_.front())});
        incoming_.pop_front();
      }
    }
    last_sequences = Step(&works, &ended);
    if (!ended.empty()) {
      {
        absl::MutexLock lock(&mu_);
        in_flight_ -= static_cast<int>(ended.size());
      }
      for (auto& [work, status] : ended) work->Finish(std::move(status));
      ended.clear();
    }
  }
  // Shutting down: nothing more runs.
  {
    absl::MutexLock lock(&mu_);
    for (auto& w : incoming_) works.push_back(Entry{std::move(w)});
    incoming_.clear();
    in_flight_ = 0;
  }
  for (Entry& e : works) {
    if (e.begun) e.work->Abort();
    e.work->Finish(absl::CancelledError("the server is shutting down"));
  }
}

int BatchScheduler::Step(std::vector<Entry>* works, Ended* ended) {
  std::vector<bool> gone(works->size(), false);
  // Start new works; one that fails to start, or needs no forward, ends.
  for (size_t i = 0; i < works->size(); ++i) {
    Entry& e = (*works)[i];
    if (e.begun) continue;
    e.begun = true;
    absl::Status s = e.work->Begin();
    if (!s.ok() || e.work->pending_rows() == 0) {
      ended->emplace_back(std::move(e.work), s);
      gone[i] = true;
    }
  }
  // Pack the budget: decode-like rows first, then prompt chunks.
  int budget = options_.max_num_batched_tokens;
  std::vector<SequenceForward> batch;
  std::vector<size_t> planned;
  StepStats stats;
  for (bool prefill_pass : {false, true}) {
    for (size_t i = 0; i < works->size(); ++i) {
      if (gone[i]) continue;
      BatchedWork& w = *(*works)[i].work;
      if (w.prefilling() != prefill_pass) continue;
      if (w.min_forward_rows() > budget) continue;
      SequenceForward entry;
      if (!w.PlanForward(std::min(budget, w.pending_rows()), &entry).ok()) {
        continue;
      }
      const int n = static_cast<int>(entry.input.token_ids.size());
      budget -= n;
      stats.rows += n;
      if (prefill_pass) stats.prefill_rows += n;
      batch.push_back(std::move(entry));
      planned.push_back(i);
    }
  }
  for (size_t i = 0; i < works->size(); ++i) stats.waiting += !gone[i];
  stats.waiting -= static_cast<int>(planned.size());
  if (batch.empty()) {
    // Every remaining work needs more rows than the whole budget: fail
    // them rather than spin.
    for (size_t i = 0; i < works->size(); ++i) {
      if (gone[i]) continue;
      BatchedWork& w = *(*works)[i].work;
      const int need = w.min_forward_rows();
      w.Abort();
      ended->emplace_back(
          std::move((*works)[i].work),
          absl::ResourceExhaustedError(absl::StrCat(
              "a forward of ", need, " rows exceeds max_num_batched_tokens ",
              options_.max_num_batched_tokens)));
      gone[i] = true;
    }
  } else {
    std::vector<ForwardOutput> outs;
    const int64_t t0 = MonotonicNowNs();
    const absl::Status fs = model_->Forward(batch, &outs);
    stats.forward_ns = MonotonicNowNs() - t0;
    stats.sequences = static_cast<int>(batch.size());
    for (size_t b = 0; b < planned.size(); ++b) {
      const size_t i = planned[b];
      BatchedWork& w = *(*works)[i].work;
      absl::Status s = fs;
      if (s.ok()) {
        s = w.CompleteForward(outs[b]);
      } else {
        w.Abort();
      }
      if (!s.ok() || w.pending_rows() == 0) {
        ended->emplace_back(std::move((*works)[i].work), s);
        gone[i] = true;
      }
    }
  }
  std::vector<Entry> keep;
  for (size_t i = 0; i < works->size(); ++i) {
    if (!gone[i]) keep.push_back(std::move((*works)[i]));
  }
  works->swap(keep);
  if (on_step_ && stats.sequences > 0) on_step_(stats);
  return stats.sequences;
}

}  // namespace specserve
