// ThreadSanitizer view of Debian's (uninstrumented) absl::Mutex, linked only
// under --config=tsan (see BUILD.bazel).
//
// The executable defines the out-of-line absl::Mutex / CondVar / Condition
// members that locking goes through; the dynamic linker then binds every
// call to them (ours, and gRPC's, whose gpr_mu is an absl::Mutex) to these
// definitions, which forward to the library's own (found with
// dlsym(RTLD_NEXT)) and tell TSan what happened with its mutex annotation
// API (sanitizer/tsan_interface.h), as Abseil itself does when it is built
// with TSan:
//  * Lock/Unlock, reader and try variants, LockWhen*: lock and unlock.
//  * Await* and CondVar::Wait* (entered and left holding the mutex, which
//    is released while waiting): an unlock before and a lock after.
//  * Notification: Notify releases, a successful WaitForNotification*
//    acquires (its flag is an atomic inside the library).
//  * Condition::Eval: reads and writes ignored. Abseil evaluates a waiter's
//    condition in whichever thread releases the mutex, at points TSan cannot
//    see as holding it; the waiter re-reads the state after it relocks.

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}

namespace {

#define SPECSERVE_STR2(x) #x
#define SPECSERVE_STR(x) SPECSERVE_STR2(x)

// The library's definition of the member whose Itanium mangled name is
// "_ZN4absl" + <inline namespace> + `suffix` (or "_ZNK..." when `is_const`).
template <typename Fn>
Fn Real(const char* suffix, bool is_const = false) {
#if defined(ABSL_OPTION_USE_INLINE_NAMESPACE) && \
    ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string ns = SPECSERVE_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string prefix =
      std::string(is_const ? "_ZNK4absl" : "_ZN4absl") +
      std::to_string(ns.size()) + ns;
#else
  const std::string prefix = is_const ? "_ZNK4absl" : "_ZN4absl";
#endif
  const std::string name = prefix + suffix;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found: %s\n", name.c_str(),
                 dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// How many of the functions below are active on this thread. Only the
// outermost one annotates: the library's members call each other through
// the PLT too (e.g. CondVar::WaitWithTimeout -> WaitWithDeadline), which
// would otherwise be annotated twice.
thread_local int tls_depth = 0;

class Scope {
 public:
  Scope() : outer_(tls_depth++ == 0) {}
  ~Scope() { --tls_depth; }
  bool outer() const { return outer_; }

 private:
  bool outer_;
};

void PreLock(const Scope& s, void* mu, unsigned flags) {
  if (s.outer()) __tsan_mutex_pre_lock(mu, flags);
}
void PostLock(const Scope& s, void* mu, unsigned flags) {
  if (s.outer()) __tsan_mutex_post_lock(mu, flags, 0);
}
void PreUnlock(const Scope& s, void* mu, unsigned flags) {
  if (s.outer()) __tsan_mutex_pre_unlock(mu, flags);
}
void PostUnlock(const Scope& s, void* mu, unsigned flags) {
  if (s.outer()) __tsan_mutex_post_unlock(mu, flags);
}

// RAII: the waiting mutex is released to TSan for the duration of a wait.
class WaitAnnotation {
 public:
  explicit WaitAnnotation(void* mu) : mu_(mu) {
    if (scope_.outer()) {
      __tsan_mutex_pre_unlock(mu_, 0);
      __tsan_mutex_post_unlock(mu_, 0);
    }
  }
  ~WaitAnnotation() {
    if (scope_.outer()) {
      __tsan_mutex_pre_lock(mu_, 0);
      __tsan_mutex_post_lock(mu_, 0, 0);
    }
  }

 private:
  Scope scope_;
  void* mu_;
};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  const Scope scope;
  PreLock(scope, this, 0);
  real(this);
  PostLock(scope, this, 0);
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  const Scope scope;
  PreUnlock(scope, this, 0);
  real(this);
  PostUnlock(scope, this, 0);
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  const Scope scope;
  PreLock(scope, this, __tsan_mutex_read_lock);
  real(this);
  PostLock(scope, this, __tsan_mutex_read_lock);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  const Scope scope;
  PreUnlock(scope, this, __tsan_mutex_read_lock);
  real(this);
  PostUnlock(scope, this, __tsan_mutex_read_lock);
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const Scope scope;
  PreLock(scope, this, __tsan_mutex_try_lock);
  const bool locked = real(this);
  PostLock(scope, this,
           __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed));
  return locked;
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  const Scope scope;
  PreLock(scope, this, flags);
  const bool locked = real(this);
  PostLock(scope, this, flags | (locked ? 0 : __tsan_mutex_try_lock_failed));
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  const Scope scope;
  PreLock(scope, this, 0);
  real(this, cond);
  PostLock(scope, this, 0);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>(
      "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  const Scope scope;
  PreLock(scope, this, __tsan_mutex_read_lock);
  real(this, cond);
  PostLock(scope, this, __tsan_mutex_read_lock);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
          "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const Scope scope;
  PreLock(scope, this, 0);
  const bool met = real(this, cond, timeout);
  PostLock(scope, this, 0);
  return met;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const Scope scope;
  PreLock(scope, this, 0);
  const bool met = real(this, cond, deadline);
  PostLock(scope, this, 0);
  return met;
}

void Mutex::Await(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>(
      "5Mutex5AwaitERKNS0_9ConditionE");
  WaitAnnotation wait(this);
  real(this, cond);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
          "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  WaitAnnotation wait(this);
  return real(this, cond, timeout);
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  WaitAnnotation wait(this);
  return real(this, cond, deadline);
}

void CondVar::Wait(Mutex* mu) {
  static const auto real =
      Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  WaitAnnotation wait(mu);
  real(this, mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  WaitAnnotation wait(mu);
  return real(this, mu, timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  WaitAnnotation wait(mu);
  return real(this, mu, deadline);
}

bool Condition::Eval() const {
  static const auto real =
      Real<bool (*)(const Condition*)>("9Condition4EvalEv", /*is_const=*/true);
  // The condition is user code: locking inside it is annotated again.
  const int depth = tls_depth;
  tls_depth = 0;
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  const bool result = real(this);
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  tls_depth = depth;
  return result;
}

void Notification::Notify() {
  static const auto real =
      Real<void (*)(Notification*)>("12Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  static const auto real = Real<void (*)(const Notification*)>(
      "12Notification19WaitForNotificationEv", /*is_const=*/true);
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(
    absl::Duration timeout) const {
  static const auto real =
      Real<bool (*)(const Notification*, absl::Duration)>(
          "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE",
          /*is_const=*/true);
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static const auto real = Real<bool (*)(const Notification*, absl::Time)>(
      "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE",
      /*is_const=*/true);
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
