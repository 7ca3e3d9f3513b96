#include "speculator_service/session_manager.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace specserve {

struct SessionManager::Lease::Entry {
  std::unique_ptr<DraftSession> session;
  absl::Time last_used;
  bool leased = false;
  bool released = false;  // unlisted while leased; freed on return
};

SessionManager::Lease& SessionManager::Lease::operator=(
    Lease&& other) noexcept {
  if (this != &other) {
    Reset();
    manager_ = std::exchange(other.manager_, nullptr);
    id_ = std::move(other.id_);
    entry_ = std::move(other.entry_);
  }
  return *this;
}

DraftSession* SessionManager::Lease::session() const {
  return entry_ ? entry_->session.get() : nullptr;
}

void SessionManager::Lease::Reset() {
  if (manager_ == nullptr) return;
  manager_->Return(entry_.get());
  manager_ = nullptr;
  entry_.reset();
}

SessionManager::SessionManager(SessionManagerOptions options, Clock clock,
                               Observer observer)
    : options_(options),
      clock_(clock ? std::move(clock) : Clock([] { return absl::Now(); })),
      observer_(std::move(observer)),
      admission_(AdmissionQueue::Options{options_.max_sessions,
                                         /*max_waiting=*/0, "max_sessions",
                                         ""}) {}

SessionManager::~SessionManager() = default;

bool SessionManager::Expired(const Entry& e, absl::Time now) const {
  return !e.leased && now - e.last_used > options_.ttl;
}

class SessionManager::Notice {
 public:
  explicit Notice(SessionManager* manager) : manager_(manager) {}
  ~Notice() {
    if (!armed_ || !manager_->observer_) return;
    absl::MutexLock lock(&manager_->observer_mu_);
    manager_->observer_();
  }
  void Arm() { armed_ = true; }

 private:
  SessionManager* const manager_;
  bool armed_ = false;
};

std::unique_ptr<DraftSession> SessionManager::EraseLocked(
    const std::string& id) {
  auto it = sessions_.find(id);
  std::shared_ptr<Entry> e = std::move(it->second);
  sessions_.erase(it);
  e->released = true;
  if (e->leased) return nullptr;  // the lease frees and uncharges it
  admission_.Release();
  return std::move(e->session);
}

void SessionManager::SweepLocked(
    absl::Time now, std::vector<std::unique_ptr<DraftSession>>* dead) {
  std::vector<std::string> expired;
  for (const auto& [id, e] : sessions_) {
    if (Expired(*e, now)) expired.push_back(id);
  }
  for (const std::string& id : expired) dead->push_back(EraseLocked(id));
}

absl::StatusOr<SessionManager::Lease> SessionManager::Add(
    std::unique_ptr<DraftSession> session) {
  Notice notice(this);
  std::vector<std::unique_ptr<DraftSession>> dead;  // freed after unlock
  absl::MutexLock lock(&mu_);
  // Full: expired sessions make room first.
  if (admission_.running() >= options_.max_sessions) {
    SweepLocked(clock_(), &dead);
  }
  if (!dead.empty()) notice.Arm();
  if (absl::StatusOr<uint64_t> admitted = admission_.AdmitOrWait(nullptr);
      !admitted.ok()) {
    return admitted.status();
  }
  std::string id;
  do {
    id = absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen_),
                         absl::Uniform<uint64_t>(gen_));
  } while (sessions_.contains(id));
  auto e = std::make_shared<Entry>();
  e->session = std::move(session);
  e->last_used = clock_();
  e->leased = true;
  sessions_[id] = e;
  notice.Arm();
  return Lease(this, id, std::move(e));
}

absl::StatusOr<SessionManager::Lease> SessionManager::Acquire(
    const std::string& id) {
  Notice notice(this);
  std::unique_ptr<DraftSession> dead;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || Expired(*it->second, clock_())) {
    if (it != sessions_.end()) {
      dead = EraseLocked(id);
      notice.Arm();
    }
    return absl::NotFoundError(
        absl::StrCat("session ", id, " expired or unknown"));
  }
  if (it->second->leased) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " is in use by another Draft stream"));
  }
  it->second->leased = true;
  return Lease(this, id, it->second);
}

bool SessionManager::Release(const std::string& id) {
  Notice notice(this);
  std::unique_ptr<DraftSession> dead;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return false;
  const bool live = !Expired(*it->second, clock_());
  dead = EraseLocked(id);
  notice.Arm();
  return live;
}

int SessionManager::Sweep() {
  Notice notice(this);
  std::vector<std::unique_ptr<DraftSession>> dead;
  absl::MutexLock lock(&mu_);
  SweepLocked(clock_(), &dead);
  if (!dead.empty()) notice.Arm();
  return static_cast<int>(dead.size());
}

void SessionManager::Return(Entry* e) {
  Notice notice(this);
  std::unique_ptr<DraftSession> dead;
  absl::MutexLock lock(&mu_);
  e->leased = false;
  e->last_used = clock_();
  if (e->released) {
    admission_.Release();
    dead = std::move(e->session);
    notice.Arm();
  }
}

int SessionManager::num_sessions() const { return admission_.running(); }


}  // namespace specserve
