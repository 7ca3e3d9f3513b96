#ifndef SPECSERVE_COMMON_SCHEDULING_SESSION_H_
#define SPECSERVE_COMMON_SCHEDULING_SESSION_H_

// The scheduler's view of a request (vLLM's Request): the step protocol of
// a model service's per-request session, as the continuous-batching loop
// drives it (docs/ARCHITECTURE.md, Scheduling). An operation is begun by
// the service (a Score or Draft of a DraftSession, a round of a
// TargetSession), then forwarded in steps that the scheduler packs with
// other sessions' rows, and ends when no rows are pending. SessionWork
// (session_work.h) makes any Session a BatchedWork; SessionRegistry
// (session_registry.h) is how the scheduler finds sessions to preempt.

#include <memory>

#include "absl/status/status.h"
#include "common/engine/model_runner.h"
#include "common/engine/paged_kv_cache.h"

namespace specserve {

struct SessionRegistryState;

/// One request's state in a model service. Not thread-safe: the scheduler
/// thread drives it while an operation is in flight, its owner otherwise.
class Session {
 public:
  /// Stops preemption (StopPreemption) if the derived class did not.
  virtual ~Session();

  /// Rows the begun operation still has to forward (an upper bound where
  /// it may end early, e.g. a look-ahead at EOS); 0 = done or none begun.
  virtual int pending_rows() const = 0;
  /// Fewest rows the next forward may take: rows that must share one
  /// forward (a verify round's last token and drafts) are never split.
  virtual int min_forward_rows() const = 0;
  /// Whether the next forward feeds context tokens (a prompt chunk, or a
  /// recomputation after preemption: chunkable, scheduled after the
  /// decode-like rows of other sessions).
  virtual bool prefilling() const = 0;
  /// Plans the next forward over at most `max_rows` (>= min_forward_rows())
  /// rows; `entry` points into the session until CompleteForward / Abort.
  /// FAILED_PRECONDITION when no operation is in progress or the rows that
  /// must go together do not fit.
  virtual absl::Status PlanForward(int max_rows, SequenceForward* entry) = 0;
  /// Consumes the planned forward's output; the last forward of an
  /// operation completes it (its result is then the session's to hand
  /// out). An error ends the operation with its KV changes undone.
  virtual absl::Status CompleteForward(const ForwardOutput& out) = 0;
  /// Ends an operation whose forward failed: the KV cache goes back to
  /// where the operation's forwards began. No-op without one.
  virtual void Abort() = 0;
  /// Preemption by recomputation (Kwon et al. SOSP 2023, section 4.5):
  /// frees every KV block between forwards; what was computed is forwarded
  /// again later, with identical results.
  virtual void Preempt() = 0;
  /// Times this session was preempted.
  virtual int num_preemptions() const = 0;
  /// The session's sequence in the model's paged KV cache.
  virtual const KvSequence* kv_sequence() const = 0;

 protected:
  /// The first thing a derived class's destructor must do: waits for a
  /// preemption of this session in progress on the scheduler's thread and
  /// takes the session off the registry, so it is never preempted half
  /// destroyed. Idempotent.
  void StopPreemption();

 private:
  friend class SessionRegistry;
  // The registry that tracks this session (SessionRegistry::Track); null
  // when untracked. Shared: the session may outlive the registry.
  std::shared_ptr<SessionRegistryState> registry_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SCHEDULING_SESSION_H_
