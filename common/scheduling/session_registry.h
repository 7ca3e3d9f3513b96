#ifndef SPECSERVE_COMMON_SCHEDULING_SESSION_REGISTRY_H_
#define SPECSERVE_COMMON_SCHEDULING_SESSION_REGISTRY_H_

// Preemption policy (vLLM v1's scheduler; preemption by recomputation,
// Kwon et al. SOSP 2023, section 4.5): which sessions give their KV blocks
// back when a step is short of them. The scheduler owns one registry;
// sessions join it when their first work is submitted and leave it when
// they are destroyed (Session::StopPreemption). The KV cache itself only
// allocates, frees, forks and truncates.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "common/engine/paged_kv_cache.h"
#include "common/scheduling/session.h"

namespace specserve {

/// The sessions of one model's scheduler, and the choice of victims.
/// Thread-safe; Preempt* run each victim's Session::Preempt on the caller's
/// thread (the scheduler's, between forwards).
class SessionRegistry {
 public:
  SessionRegistry();
  /// Sessions still tracked are released (they can be destroyed later).
  ~SessionRegistry();
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;

  /// Tracks `session` (idempotent; a session tracked by another registry
  /// stays there).
  void Track(Session* session);
  /// Sessions tracked now.
  int size() const;

  /// Preempts tracked sessions whose sequence is newer than `after_id`
  /// (KvSequence::id) and holds blocks, newest first, until
  /// cache.num_available_blocks() >= `want_available` or none is left.
  /// Returns their sequences, newest first.
  std::vector<const KvSequence*> PreemptNewest(const PagedKvCache& cache,
                                               int want_available,
                                               uint64_t after_id);
  /// The same for idle sessions: tracked sessions whose sequence is NOT in
  /// `busy` (of any age), holds blocks and was last reserved into before
  /// `idle_since_ns` (MonotonicNowNs clock), least recently used first.
  std::vector<const KvSequence*> PreemptIdle(
      const PagedKvCache& cache, int want_available,
      const absl::flat_hash_set<const KvSequence*>& busy,
      int64_t idle_since_ns);

 private:
  std::shared_ptr<SessionRegistryState> state_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SCHEDULING_SESSION_REGISTRY_H_
