#ifndef SPECSERVE_COMMON_SCHEDULING_BATCH_SCHEDULER_H_
#define SPECSERVE_COMMON_SCHEDULING_BATCH_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/engine/model_runner.h"
#include "common/scheduling/session.h"
#include "common/scheduling/session_registry.h"

namespace specserve {

/// A piece of per-request work that takes one or more forwards of one
/// sequence (a target round, a Speculative Prefill scoring, a draft
/// proposal), driven by a BatchScheduler that puts the forwards of many
/// requests into one batched ModelRunner::Forward. Called on the
/// scheduler's thread only, in the order Begin, then (PlanForward,
/// CompleteForward)* while pending_rows() > 0, then Finish exactly once.
class BatchedWork {
 public:
  virtual ~BatchedWork() = default;
  /// Starts the work; an error ends it (Finish gets the error).
  virtual absl::Status Begin() = 0;
  /// Rows still to forward; 0 = done (Finish(OK) follows).
  virtual int pending_rows() const = 0;
  /// Fewest rows the next forward may take (a verify round's 1 + k rows
  /// are never split; prompt chunks can be 1 row).
  virtual int min_forward_rows() const = 0;
  /// Whether the next forward is a prompt chunk (scheduled after the
  /// decode-like rows of other requests).
  virtual bool prefilling() const = 0;
  /// Plans the next forward over at most max_rows (>= min_forward_rows())
  /// rows; `entry` may point into the work until CompleteForward.
  virtual absl::Status PlanForward(int max_rows, SequenceForward* entry) = 0;
  /// Consumes the planned forward's output; an error ends the work.
  virtual absl::Status CompleteForward(const ForwardOutput& out) = 0;
  /// Undoes the started work's KV cache changes after a failed forward.
  virtual void Abort() = 0;
  /// The work's end: OK (results are in the work) or the error that ended
  /// it. Runs on the scheduler thread, outside its locks; the scheduler
  /// destroys the work right after.
  virtual void Finish(absl::Status status) = 0;
  /// The KV sequence the work runs on, or nullptr. A sequence no work in
  /// flight runs on is idle (a kept speculator session between requests, a
  /// target stream between rounds): the scheduler may preempt it when a
  /// waiting work finds no free blocks.
  virtual const KvSequence* sequence() const { return nullptr; }
  /// The session the work runs on, or nullptr: submitting the work puts
  /// the session in the scheduler's SessionRegistry (preemptible, also
  /// while idle, until it stops preemption).
  virtual Session* session() const { return nullptr; }
};

/// Continuous batching over one ModelRunner: iteration-level scheduling
/// (Orca, Yu et al. OSDI 2022) with chunked prefill (Sarathi, Agrawal et
/// al. 2023) in vLLM v1's shape. One loop thread; each step packs a token
/// budget from the works in flight, decode-like rows first (never split),
/// then prompt chunks, so a long prompt never stalls the streaming
/// requests; one batched forward; then each work's rows go back to it.
/// Works run in submission order within each class; a work that needs more
/// rows than are left this step waits for the next.
///
/// KV memory (vLLM's scheduler with preemption by recomputation): before
/// the forward, the step's works claim the KV blocks their rows need,
/// oldest sequence (KvSequence::id) first. A sequence that holds blocks
/// and needs more preempts newer sequences, newest first
/// (SessionRegistry::PreemptNewest), and waits if that is not enough; a
/// sequence that holds none (a new or preempted request) never preempts a
/// running one: it starts when the free blocks cover it plus the
/// watermark (or, if it needs more than the pool less the watermark, when
/// they cover it), and newer block-less ones wait behind it (first come,
/// first served). Either kind, when short, first preempts IDLE sequences (no
/// work in flight and unused for Options::idle_preempt_after: kept
/// speculator sessions between requests, abandoned streams;
/// SessionRegistry::PreemptIdle, least recently used first), which would
/// otherwise hold the pool until their requests end. So a
/// temporary lack of blocks delays requests instead of failing them; a
/// work that could not fit in the whole pool fails RESOURCE_EXHAUSTED.
/// Thread-safe.
class BatchScheduler {
 public:
  struct Options {
    /// Rows (tokens) per batched forward, >= every work's largest
    /// min_forward_rows() (else that work fails RESOURCE_EXHAUSTED).
    int max_num_batched_tokens = 2048;
    /// Before a step, when every work of the previous step has ended, wait
    /// up to this long for them to come back (a stream's next round
    /// arrives one client round trip after its last one ended): without it
    /// the running requests split into alternating half-size batches. A
    /// work still in flight (a draft's next depth, a prompt's next chunk)
    /// never waits. 0 = never wait.
    absl::Duration max_batch_wait = absl::Milliseconds(2);
    /// Fraction of the KV pool kept free when a work whose sequence holds
    /// no blocks (a new or preempted request) starts: vLLM's watermark,
    /// so that admitting a request does not immediately force preemptions.
    /// A work that needs more than the pool less the watermark waits for
    /// the blocks it needs only (else it would never start).
    double kv_watermark = 0.01;
    /// A sequence no work has used for this long (a kept speculator
    /// session between requests, an abandoned stream) may be preempted
    /// when a work is short of KV blocks; more briefly idle ones (a
    /// stream between two rounds) are not.
    absl::Duration idle_preempt_after = absl::Milliseconds(200);
    /// Works queued or running at most (the speculator's --max_queue);
    /// Submit past it is RESOURCE_EXHAUSTED. 0 = no limit.
    int max_works = 0;
  };
  /// What one step did (the serving loop's metrics).
  struct StepStats {
    int sequences = 0;       ///< works in the forward
    int rows = 0;            ///< rows (tokens) forwarded
    int prefill_rows = 0;    ///< of those, prompt-chunk rows
    int waiting = 0;         ///< works in flight that got no rows
    /// Of those, works that got no KV blocks (they wait for memory).
    int waiting_for_kv = 0;
    /// Sequences preempted this step (their blocks taken back; they
    /// recompute later: vLLM's num_preemptions).
    int preempted = 0;
    int64_t forward_ns = 0;  ///< the batched forward's time
    /// Host time between the previous step's forward and this one's, when
    /// both steps forwarded (else 0): finishing and completing works,
    /// waiting for streams to send their next round, planning, claiming
    /// blocks; not the time the loop slept with no work at all. The GPU
    /// idles for it (nothing overlaps a forward).
    int64_t gap_ns = 0;
  };
  /// Called on the loop thread after every step that forwarded,
  /// preempted or left a work waiting, and once after the first step that
  /// did none of these (all zeros), so gauges fed from it return to idle.
  using StepObserver = std::function<void(const StepStats&)>;

  /// INVALID_ARGUMENT for a null model or max_num_batched_tokens < 1.
  static absl::StatusOr<std::unique_ptr<BatchScheduler>> Create(
      ModelRunner* model, Options options, StepObserver on_step = nullptr);
  /// Stops the loop; works still in flight are aborted and finish with
  /// CANCELLED.
  ~BatchScheduler();
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  /// Queues `work`. UNAVAILABLE once shutting down, RESOURCE_EXHAUSTED with
  /// Options::max_works works in flight (then the work is destroyed
  /// without Finish).
  absl::Status Submit(std::unique_ptr<BatchedWork> work);
  /// Works queued or in flight.
  int num_works() const;
  const Options& options() const { return options_; }

 private:
  struct Entry {
    std::unique_ptr<BatchedWork> work;
    bool begun = false;
  };
  using Ended = std::vector<std::pair<std::unique_ptr<BatchedWork>,
                                      absl::Status>>;
  BatchScheduler(ModelRunner* model, Options options, StepObserver on_step);
  void Loop();
  // One step over the loop's own list; ended works move to `ended`.
  // Returns the works the step's forward carried.
  int Step(std::vector<Entry>* works, Ended* ended);
  // The memory phase of a step: claims KV blocks for the planned entries
  // (see the class comment) and clears keep[b] for the entries that must
  // wait; works whose need exceeds the whole pool are added to `fail`.
  // `works`: every work in flight (sequences none of them runs on are idle).
  void ClaimKvBlocks(const std::vector<SequenceForward>& batch,
                     const std::vector<Entry>& works, std::vector<bool>* keep,
                     std::vector<bool>* fail, StepStats* stats);

  ModelRunner* const model_;
  const Options options_;
  SessionRegistry registry_;  // the sessions works were submitted for
  const StepObserver on_step_;
  bool reported_busy_ = false;  // the last report was not all zeros (loop)
  // When the last step's forward ended; 0 if that step did not forward
  // (loop thread only).
  int64_t last_forward_end_ns_ = 0;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<BatchedWork>> incoming_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SCHEDULING_BATCH_SCHEDULER_H_
