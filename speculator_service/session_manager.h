#ifndef SPECSERVE_SPECULATOR_SERVICE_SESSION_MANAGER_H_
#define SPECSERVE_SPECULATOR_SERVICE_SESSION_MANAGER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/scheduling/admission_queue.h"
#include "common/speculation/draft_session.h"

namespace specserve {

/// Limits on the speculator's live sessions (each holds a KV cache).
struct SessionManagerOptions {
  int max_sessions = 64;                  ///< live sessions, >= 1.
  absl::Duration ttl = absl::Minutes(5);  ///< idle time before reaping.
};

/// Owns the speculator's DraftSessions by id (random 128-bit hex), at most
/// max_sessions (an AdmissionQueue without waiting room); overload is
/// RESOURCE_EXHAUSTED, never a queue
/// (Envoy-style). KV memory is not charged here: sessions take blocks of
/// the model's paged cache as they grow, and the scheduler preempts the
/// newest ones when it runs out (DraftSession::Preempt).
///
/// Use goes through exclusive leases: a leased session is never reaped, and
/// Release() of a leased session only unlists it (new Acquires fail); its
/// memory is freed, and its charge returned, when the lease ends. A session
/// idle (unleased) for longer than the TTL is expired: reaped lazily by
/// Acquire/Add and by Sweep(), which a server calls periodically.
/// Thread-safe. Leases must not outlive the manager.
class SessionManager {
 public:
  /// Returns "now"; injectable for tests.
  using Clock = std::function<absl::Time()>;
  /// Called after every change, outside the manager's lock and after the
  /// sessions it freed are destroyed (so their KV blocks are back): read
  /// the state to report (num_sessions(), the cache's bytes) there. Calls
  /// never overlap, and each reads the state current at its time, so the
  /// last one reports the final state (overlapping calls could set a gauge
  /// from a stale read last).
  using Observer = std::function<void()>;

  /// Exclusive use of one session; returns it (refreshing its idle timer)
  /// or frees it if it was released meanwhile, when destroyed. Movable.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { Reset(); }

    const std::string& id() const { return id_; }
    DraftSession* session() const;
    explicit operator bool() const { return manager_ != nullptr; }
    /// Ends the lease now (no-op if empty).
    void Reset();

   private:
    friend class SessionManager;
    struct Entry;
    Lease(SessionManager* m, std::string id, std::shared_ptr<Entry> e)
        : manager_(m), id_(std::move(id)), entry_(std::move(e)) {}
    SessionManager* manager_ = nullptr;
    std::string id_;
    std::shared_ptr<Entry> entry_;
  };

  explicit SessionManager(SessionManagerOptions options, Clock clock = nullptr,
                          Observer observer = nullptr);
  ~SessionManager();
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  /// Admits `session` under a fresh id and returns it leased. Expired
  /// sessions are reaped first. RESOURCE_EXHAUSTED naming max_sessions when
  /// that many are live.
  absl::StatusOr<Lease> Add(std::unique_ptr<DraftSession> session);

  /// Leases session `id`. NOT_FOUND "session <id> expired or unknown" (an
  /// expired one is reaped); FAILED_PRECONDITION if it is already leased
  /// (a session serves one Draft stream at a time).
  absl::StatusOr<Lease> Acquire(const std::string& id);

  /// Unlists `id`: freed now, or when its lease ends. False if unknown,
  /// expired (then reaped) or already released.
  bool Release(const std::string& id);

  /// Reaps every expired session; returns how many.
  int Sweep();

  /// Sessions holding memory (listed, or released but still leased).
  int num_sessions() const;
  const SessionManagerOptions& options() const { return options_; }

 private:
  using Entry = Lease::Entry;
  bool Expired(const Entry& e, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unlists `it`'s entry and uncharges it; returns the session to destroy
  // outside the lock.
  std::unique_ptr<DraftSession> EraseLocked(const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLocked(absl::Time now,
                   std::vector<std::unique_ptr<DraftSession>>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Return(Entry* entry);
  // Runs the observer when it goes out of scope: declared before a
  // method's lock and dead sessions, it fires after both are gone.
  class Notice;

  const SessionManagerOptions options_;
  const Clock clock_;
  const Observer observer_;
  // Serializes the observer's calls (taken with mu_ released).
  absl::Mutex observer_mu_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> sessions_
      ABSL_GUARDED_BY(mu_);
  // Sessions holding memory count against max_sessions here (admitted in
  // Add, released when freed); no waiting room: past it Add fails.
  AdmissionQueue admission_;
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specserve

#endif  // SPECSERVE_SPECULATOR_SERVICE_SESSION_MANAGER_H_
