#include "common/scheduling/session_registry.h"

#include <algorithm>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace specserve {

// Shared by the registry and the sessions it tracks, so that either may go
// first. The mutex is held while a victim's Preempt runs: a session that
// stops preemption (in its destructor) waits for it.
struct SessionRegistryState {
  absl::Mutex mu;
  absl::flat_hash_set<Session*> sessions ABSL_GUARDED_BY(mu);
};

Session::~Session() { StopPreemption(); }

void Session::StopPreemption() {
  if (registry_ == nullptr) return;
  {
    absl::MutexLock lock(&registry_->mu);
    registry_->sessions.erase(this);
  }
  registry_.reset();
}

SessionRegistry::SessionRegistry()
    : state_(std::make_shared<SessionRegistryState>()) {}

SessionRegistry::~SessionRegistry() {
  absl::MutexLock lock(&state_->mu);
  state_->sessions.clear();
}

void SessionRegistry::Track(Session* session) {
  if (session == nullptr || session->registry_ != nullptr) return;
  // The session's owner submits its work: no other thread touches
  // registry_ now (Preempt* only read the set).
  session->registry_ = state_;
  absl::MutexLock lock(&state_->mu);
  state_->sessions.insert(session);
}

int SessionRegistry::size() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->sessions.size());
}

std::vector<const KvSequence*> SessionRegistry::PreemptNewest(
    const PagedKvCache& cache, int want_available, uint64_t after_id) {
  std::vector<const KvSequence*> preempted;
  absl::MutexLock lock(&state_->mu);
  if (cache.num_available_blocks() >= want_available) return preempted;
  std::vector<std::pair<uint64_t, Session*>> newer;
  for (Session* s : state_->sessions) {
    const KvSequence* kv = s->kv_sequence();
    if (kv != nullptr && kv->id() > after_id && !kv->block_table().empty()) {
      newer.emplace_back(kv->id(), s);
    }
  }
  std::sort(newer.begin(), newer.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [id, s] : newer) {
    if (cache.num_available_blocks() >= want_available) break;
    preempted.push_back(s->kv_sequence());
    s->Preempt();
  }
  return preempted;
}

std::vector<const KvSequence*> SessionRegistry::PreemptIdle(
    const PagedKvCache& cache, int want_available,
    const absl::flat_hash_set<const KvSequence*>& busy,
    int64_t idle_since_ns) {
  std::vector<const KvSequence*> preempted;
  absl::MutexLock lock(&state_->mu);
  if (cache.num_available_blocks() >= want_available) return preempted;
  std::vector<std::pair<int64_t, Session*>> idle;
  for (Session* s : state_->sessions) {
    const KvSequence* kv = s->kv_sequence();
    if (kv == nullptr || kv->block_table().empty() || busy.contains(kv)) {
      continue;
    }
    const int64_t used = kv->last_used_ns();
    if (used < idle_since_ns) idle.emplace_back(used, s);
  }
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [used, s] : idle) {
    if (cache.num_available_blocks() >= want_available) break;
    preempted.push_back(s->kv_sequence());
    s->Preempt();
  }
  return preempted;
}

}  // namespace specserve
