#include "common/scheduling/batch_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
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
  // Preemptible from now on, until the session stops preemption.
  registry_.Track(work->session());
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError("the scheduler is shutting down");
  if (options_.max_works > 0 && in_flight_ >= options_.max_works) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "overloaded: ", in_flight_,
        " operations are queued or running (max_queue)"));
  }
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
      // Idle: sleep until work arrives (or shutdown). Works that wait for
      // KV blocks (the last step forwarded nothing) poll every
      // millisecond: blocks come back when other threads end requests.
      const absl::Condition arrived(
          +[](BatchScheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->stop_ || !s->incoming_.empty();
          },
          this);
      if (works.empty()) {
        // Idle time is not host time between forwards (StepStats::gap_ns):
        // the reference moves past the sleep.
        const int64_t idle_from = MonotonicNowNs();
        mu_.Await(arrived);
        if (last_forward_end_ns_ > 0) {
          last_forward_end_ns_ += MonotonicNowNs() - idle_from;
        }
      } else if (last_sequences == 0) {
        mu_.AwaitWithTimeout(arrived, absl::Milliseconds(1));
      }
      // Give the previous step's requests a moment to send their next
      // work, so that they share this step instead of the next one; but
      // only when every work of that step has ended: a work still in flight
      // (a draft's next depth, a prompt's next chunk) must not stall for
      // the others' round trips.
      const size_t want = static_cast<size_t>(last_sequences);
      if (!stop_ && works.empty() && incoming_.size() < want &&
          options_.max_batch_wait > absl::ZeroDuration()) {
        struct Arg {
          BatchScheduler* s;
          size_t need;
        } arg{this, want};
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
  std::vector<bool> planned_prefill;
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
      planned_prefill.push_back(prefill_pass);
    }
  }
  // Claim the KV blocks the planned rows need; entries that must wait for
  // memory leave the batch (their plans are made again next step).
  if (!batch.empty()) {
    std::vector<bool> keep(batch.size(), true), fail(batch.size(), false);
    ClaimKvBlocks(batch, *works, &keep, &fail, &stats);
    size_t kept = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      if (fail[b]) {
        BatchedWork& w = *(*works)[planned[b]].work;
        const int blocks = batch[b].kv->BlocksToReserve(
            static_cast<int>(batch[b].input.token_ids.size()));
        w.Abort();
        ended->emplace_back(
            std::move((*works)[planned[b]].work),
            absl::ResourceExhaustedError(absl::StrCat(
                "the KV cache cannot hold this request: it needs ",
                batch[b].kv->block_table().size() + blocks,
                " blocks, the pool has ", model_->kv_cache().num_blocks())));
        gone[planned[b]] = true;
      }
      if (!keep[b]) {
        const int n = static_cast<int>(batch[b].input.token_ids.size());
        stats.rows -= n;
        if (planned_prefill[b]) stats.prefill_rows -= n;
        continue;
      }
      if (kept != b) {  // a self-move would empty the entry's vectors
        batch[kept] = std::move(batch[b]);
        planned[kept] = planned[b];
      }
      ++kept;
    }
    batch.resize(kept);
    planned.resize(kept);
  }
  for (size_t i = 0; i < works->size(); ++i) stats.waiting += !gone[i];
  stats.waiting -= static_cast<int>(planned.size());
  if (batch.empty() && stats.waiting_for_kv > 0) {
    // Everything planned waits for KV blocks that running requests hold:
    // nothing to forward this step.
  } else if (batch.empty()) {
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
    if (last_forward_end_ns_ > 0) stats.gap_ns = t0 - last_forward_end_ns_;
    const absl::Status fs = model_->Forward(batch, &outs);
    last_forward_end_ns_ = MonotonicNowNs();
    stats.forward_ns = last_forward_end_ns_ - t0;
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
  if (stats.sequences == 0) last_forward_end_ns_ = 0;
  std::vector<Entry> keep;
  for (size_t i = 0; i < works->size(); ++i) {
    if (!gone[i]) keep.push_back(std::move((*works)[i]));
  }
  works->swap(keep);
  const bool busy =
      stats.sequences > 0 || stats.preempted > 0 || stats.waiting > 0;
  if (on_step_ && (busy || reported_busy_)) on_step_(stats);
  reported_busy_ = busy;
  return stats.sequences;
}

void BatchScheduler::ClaimKvBlocks(const std::vector<SequenceForward>& batch,
                                   const std::vector<Entry>& works,
                                   std::vector<bool>* keep,
                                   std::vector<bool>* fail,
                                   StepStats* stats) {
  PagedKvCache& cache = model_->kv_cache();
  const int watermark = static_cast<int>(
      std::ceil(options_.kv_watermark * cache.num_blocks()));
  std::vector<int> need(batch.size());
  int total = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    need[b] = batch[b].kv->BlocksToReserve(
        static_cast<int>(batch[b].input.token_ids.size()));
    total += need[b];
  }
  // The common case: no memory pressure, nothing to decide.
  if (total + watermark <= cache.num_free_blocks()) return;

  // Under pressure only: the sequences some work in flight runs on (the
  // rest are idle, PreemptIdle's candidates).
  absl::flat_hash_set<const KvSequence*> busy;
  for (const Entry& e : works) {
    if (e.work != nullptr && e.work->sequence() != nullptr) {
      busy.insert(e.work->sequence());
    }
  }
  for (const SequenceForward& f : batch) busy.insert(f.kv);

  std::vector<size_t> order(batch.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&batch](size_t a, size_t b) {
    return batch[a].kv->id() < batch[b].kv->id();
  });
  int available = cache.num_available_blocks();
  int claimed = 0;       // blocks promised to the entries kept so far
  bool blocked = false;  // a block-less sequence waits: newer ones too
  for (size_t b : order) {
    if (!(*keep)[b]) continue;  // preempted by an older entry
    const KvSequence& kv = *batch[b].kv;
    const int held = static_cast<int>(kv.block_table().size());
    if (held + need[b] > cache.num_blocks()) {
      (*fail)[b] = true;
      (*keep)[b] = false;
      continue;
    }
    // The watermark is headroom for the running requests; a sequence that
    // needs (nearly) the whole pool gets less, down to none, so that it
    // starts once every block is free instead of never (a preempted
    // request near its full length recomputing in one chunk).
    const int headroom =
        std::min(watermark, cache.num_blocks() - held - need[b]);
    // Sequences idle for a while go first when memory is short: nothing
    // runs on them. (Briefly idle ones, e.g. target streams waiting for the
    // client's next drafts, would be back within milliseconds and pay a
    // full recomputation.)
    if (!blocked && available - claimed - need[b] < headroom) {
      stats->preempted += static_cast<int>(
          registry_
              .PreemptIdle(cache, claimed + need[b] + headroom, busy,
                           MonotonicNowNs() -
                               absl::ToInt64Nanoseconds(
                                   options_.idle_preempt_after))
              .size());
      available = cache.num_available_blocks();
    }
    if (held == 0) {
      if (blocked || available - claimed - need[b] < headroom) {
        blocked = true;
        (*keep)[b] = false;
        ++stats->waiting_for_kv;
        continue;
      }
    } else if (available - claimed < need[b]) {
      const std::vector<const KvSequence*> victims =
          registry_.PreemptNewest(cache, claimed + need[b], kv.id());
      stats->preempted += static_cast<int>(victims.size());
      for (const KvSequence* v : victims) {
        for (size_t c = 0; c < batch.size(); ++c) {
          if (batch[c].kv == v && (*keep)[c]) {
            (*keep)[c] = false;
            ++stats->waiting_for_kv;
          }
        }
      }
      available = cache.num_available_blocks();
      if (available - claimed < need[b]) {
        (*keep)[b] = false;
        ++stats->waiting_for_kv;
        continue;
      }
    }
    claimed += need[b];
  }
}

}  // namespace specserve
