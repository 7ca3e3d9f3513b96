// ThreadSanitizer view of the hand-offs inside Debian's (uninstrumented)
// gRPC core, linked only under --config=tsan (see BUILD.bazel).
//
// gRPC's callback API runs a reactor's reactions (OnReadDone, OnWriteDone,
// OnDone, a unary handler...) on whichever gRPC thread completes the
// operation, and core passes the operation from the thread that started it
// to that thread through lock-free queues and atomics TSan cannot see. So
// TSan sees no happens-before between, say, a reactor's StartWrite on our
// scheduler thread and its OnWriteDone on a gRPC thread, and reports every
// member both touch. This file models gRPC's guarantee explicitly, per
// operation, the way tsan_absl_sync.cc does for absl::Mutex:
//
//  * grpc_call_start_batch(call, ops, n, tag): __tsan_release(tag) before
//    the batch goes to core. A callback-API tag is a
//    grpc_completion_queue_functor that core completes by calling its
//    functor_run; that pointer is swapped for a trampoline that does
//    __tsan_acquire(tag) and then runs the original. So everything the
//    starting thread did before starting an operation happens-before the
//    reaction to that operation, and nothing else is ordered: reactions to
//    different operations, and other threads, stay unordered and checked.
//  * grpc_completion_queue_next / pluck (the sync and async APIs' tags):
//    __tsan_acquire(tag) on a returned completion.
//  * grpc_core::Server::SetRegisteredMethodAllocator / SetBatchMethodAllocator
//    (how libgrpc++ asks core for new callback-API calls): the allocator
//    libgrpc++ passes is wrapped so that the new call's tag is released
//    where it is allocated and acquired (trampoline) where core hands the
//    call to its handler on another thread.
//  * Reference counts libgrpc++ keeps with atomics inside the library: a
//    server call's callbacks (OnCancel before OnDone) and the server's
//    outstanding calls (all before Shutdown returns); see namespace grpc
//    below.
//
// The interposed functions are found by the dynamic linker because the
// executable defines them (libgrpc++ calls them through the PLT); the real
// ones are found with dlsym(RTLD_NEXT). The trampolines' bookkeeping runs
// with TSan's synchronization ignored, so it adds no happens-before edges
// of its own. tsan_grpc_sync_test checks both that a correct hand-off is
// not reported and that a racy one still is.

#include <dlfcn.h>
#include <grpc/grpc.h>
#include <grpcpp/server.h>
#include <grpcpp/support/server_callback.h>
#include <link.h>
#include <sanitizer/tsan_interface.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <utility>

extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}

namespace {

using FunctorRun = void (*)(grpc_completion_queue_functor*, int);

// Looks up the next definition of the C function `name` (the library's).
template <typename Fn>
Fn RealC(const char* name) {
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_grpc_sync: %s not found: %s\n", name,
                 dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// The distinct original functor_run functions seen so far (a handful:
// grpc++'s CallbackWithSuccessTag / CallbackWithStatusTag::StaticRun, maybe
// one copy per shared object, and libgrpc++'s new-call tag), each with its
// own trampoline, so the tag itself needs no extra storage.
constexpr int kMaxRuns = 64;
std::array<std::atomic<FunctorRun>, kMaxRuns> g_originals{};

template <int I>
void Trampoline(grpc_completion_queue_functor* tag, int ok) {
  // Relaxed: written once before the trampoline is installed; no
  // happens-before edge of its own.
  const FunctorRun original = g_originals[I].load(std::memory_order_relaxed);
  __tsan_acquire(tag);
  original(tag, ok);
}

template <int... I>
constexpr std::array<FunctorRun, sizeof...(I)> MakeTrampolines(
    std::integer_sequence<int, I...>) {
  return {&Trampoline<I>...};
}
constexpr std::array<FunctorRun, kMaxRuns> kTrampolines =
    MakeTrampolines(std::make_integer_sequence<int, kMaxRuns>());

// RAII: the enclosed bookkeeping is invisible to TSan (its mutex would
// otherwise order every thread that starts a gRPC operation).
class Invisible {
 public:
  Invisible() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~Invisible() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
};

// Whether `addr` lies in an executable segment of a loaded object.
bool IsCode(uintptr_t addr) {
  struct Query {
    uintptr_t addr;
    bool found;
  } q{addr, false};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* q = static_cast<Query*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || (ph.p_flags & PF_X) == 0) continue;
          const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
          if (q->addr >= start && q->addr < start + ph.p_memsz) {
            q->found = true;
            return 1;
          }
        }
        return 0;
      },
      &q);
  return q.found;
}

// What a value found in a tag's first word is: kNotCode (a vtable pointer:
// the tag is a grpc++ CompletionQueueTag of the sync / async APIs), kOurs
// (one of the trampolines: the tag is already wrapped, as grpc++ re-uses a
// tag for every read or write of a stream) or the index of the trampoline
// for that original functor_run.
constexpr int kNotCode = -1;
constexpr int kOurs = -2;

std::mutex g_mu;
std::unordered_map<uintptr_t, int>* g_kinds = nullptr;  // guarded by g_mu
int g_num_originals = 0;                                // guarded by g_mu

int Classify(uintptr_t first_word) {
  const Invisible invisible;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_kinds == nullptr) {
    g_kinds = new std::unordered_map<uintptr_t, int>();
    for (FunctorRun t : kTrampolines) {
      (*g_kinds)[reinterpret_cast<uintptr_t>(t)] = kOurs;
    }
  }
  auto it = g_kinds->find(first_word);
  if (it != g_kinds->end()) return it->second;
  int kind = kNotCode;
  if (IsCode(first_word)) {
    if (g_num_originals == kMaxRuns) {
      std::fprintf(stderr,
                   "tsan_grpc_sync: more than %d distinct functor_run "
                   "functions; raise kMaxRuns\n",
                   kMaxRuns);
      std::abort();
    }
    kind = g_num_originals++;
    g_originals[kind].store(reinterpret_cast<FunctorRun>(first_word),
                            std::memory_order_relaxed);
  }
  (*g_kinds)[first_word] = kind;
  return kind;
}

// Called before `tag` goes to gRPC core: releases it and, for a callback-API
// functor, routes its completion through a trampoline that acquires it.
void ReleaseTag(void* tag) {
  if (tag == nullptr) return;
  auto* functor = static_cast<grpc_completion_queue_functor*>(tag);
  uintptr_t first_word;
  {
    const Invisible invisible;  // core may be reading a re-used tag
    first_word = reinterpret_cast<uintptr_t>(functor->functor_run);
  }
  const int kind = Classify(first_word);
  if (kind >= 0) {
    const Invisible invisible;
    functor->functor_run = kTrampolines[kind];
  }
  __tsan_release(tag);
}

}  // namespace

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops,
                                      size_t nops, void* tag,
                                      void* reserved) {
  static const auto real =
      RealC<grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*,
                                void*)>("grpc_call_start_batch");
  ReleaseTag(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq,
                                      gpr_timespec deadline, void* reserved) {
  static const auto real =
      RealC<grpc_event (*)(grpc_completion_queue*, gpr_timespec, void*)>(
          "grpc_completion_queue_next");
  const grpc_event ev = real(cq, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE && ev.tag != nullptr) __tsan_acquire(ev.tag);
  return ev;
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag,
                                       gpr_timespec deadline, void* reserved) {
  static const auto real =
      RealC<grpc_event (*)(grpc_completion_queue*, void*, gpr_timespec,
                           void*)>("grpc_completion_queue_pluck");
  const grpc_event ev = real(cq, tag, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE && ev.tag != nullptr) __tsan_acquire(ev.tag);
  return ev;
}

}  // extern "C"

// gRPC core's C++ server API that libgrpc++ uses for callback-API calls
// (src/core/lib/surface/server.h of gRPC 1.51). Only the members used here
// are declared; the definitions below replace the library's (same mangled
// names) and forward to it.
namespace grpc_core {

class Server {
 public:
  /// Where core puts a new call for a registered method; `tag` first.
  struct RegisteredCallAllocation {
    void* tag;
    grpc_call** call;
    grpc_metadata_array* initial_metadata;
    gpr_timespec* deadline;
    grpc_byte_buffer** optional_payload;
    grpc_completion_queue* cq;
  };
  /// Where core puts a new call for an unregistered method; `tag` first.
  struct BatchCallAllocation {
    void* tag;
    grpc_call** call;
    grpc_metadata_array* initial_metadata;
    grpc_call_details* details;
    grpc_completion_queue* cq;
  };

  /// Forwards to the library with an allocator whose tags are released.
  void SetRegisteredMethodAllocator(
      grpc_completion_queue* cq, void* method_tag,
      std::function<RegisteredCallAllocation()> allocator);
  /// Forwards to the library with an allocator whose tags are released.
  void SetBatchMethodAllocator(grpc_completion_queue* cq,
                               std::function<BatchCallAllocation()> allocator);
};

void Server::SetRegisteredMethodAllocator(
    grpc_completion_queue* cq, void* method_tag,
    std::function<RegisteredCallAllocation()> allocator) {
  using Fn = void (*)(Server*, grpc_completion_queue*, void*,
                      std::function<RegisteredCallAllocation()>*);
  static const auto real = RealC<Fn>(
      "_ZN9grpc_core6Server28SetRegisteredMethodAllocatorEP21grpc_completion_"
      "queuePvSt8functionIFNS0_24RegisteredCallAllocationEvEE");
  std::function<RegisteredCallAllocation()> wrapped =
      [allocator = std::move(allocator)] {
        RegisteredCallAllocation a = allocator();
        ReleaseTag(a.tag);
        return a;
      };
  // std::function is passed by invisible reference in the Itanium ABI.
  real(this, cq, method_tag, &wrapped);
}

void Server::SetBatchMethodAllocator(
    grpc_completion_queue* cq, std::function<BatchCallAllocation()> allocator) {
  using Fn = void (*)(Server*, grpc_completion_queue*,
                      std::function<BatchCallAllocation()>*);
  static const auto real = RealC<Fn>(
      "_ZN9grpc_core6Server23SetBatchMethodAllocatorEP21grpc_completion_"
      "queueSt8functionIFNS0_19BatchCallAllocationEvEE");
  std::function<BatchCallAllocation()> wrapped =
      [allocator = std::move(allocator)] {
        BatchCallAllocation a = allocator();
        ReleaseTag(a.tag);
        return a;
      };
  real(this, cq, &wrapped);
}

}  // namespace grpc_core

// libgrpc++'s reference counts, decremented partly in our (instrumented)
// inline grpc++ code and partly inside libgrpc++, where TSan does not see
// the atomics. Each is modeled where libgrpc++ acts on the count reaching
// zero, through functions it calls through the PLT.
namespace grpc {

// The server counts its outstanding callback-API requests; Shutdown waits
// (UnrefAndWaitLocked) until the last is gone (UnrefWithPossibleNotify,
// after the call's OnDone). Only the last decrement takes the lock TSan
// sees, so without these edges what our reactions touched looks unordered
// with destroying the service after Shutdown returns: release on every
// decrement, acquire once the count reached zero.
void Server::UnrefWithPossibleNotify() {
  static const auto real = RealC<void (*)(Server*)>(
      "_ZN4grpc6Server23UnrefWithPossibleNotifyEv");
  __tsan_release(this);
  real(this);
}

void Server::UnrefAndWaitLocked() {
  static const auto real =
      RealC<void (*)(Server*)>("_ZN4grpc6Server18UnrefAndWaitLockedEv");
  real(this);
  __tsan_acquire(this);
}

namespace internal {

// A callback-API server call runs OnDone once its callbacks_outstanding_
// count reaches zero. Our inline MaybeDone decrements it with an atomic TSan
// sees, but the OnCancel reaction's MaybeDone runs inside libgrpc++
// (ServerCallbackCall::CallOnCancel), so when that one is the last the
// earlier decrements' releases are never acquired: acquire the count's
// address (the atomic's own synchronization object) before OnDone.
void ServerCallbackCall::ScheduleOnDone(bool inline_ondone) {
  static const auto real = RealC<void (*)(ServerCallbackCall*, bool)>(
      "_ZN4grpc8internal18ServerCallbackCall14ScheduleOnDoneEb");
  __tsan_acquire(&callbacks_outstanding_);
  real(this, inline_ondone);
}

namespace {

// Stands in for a reactor in CallOnCancel: runs its OnCancel, then releases
// the call's reference count as the decrement that follows would (see
// CallOnCancel). Used once, for OnCancel and InternalInlineable only.
class CancelReactor final : public ServerReactor {
 public:
  CancelReactor(ServerReactor* reactor, std::atomic_int* count)
      : reactor_(reactor), count_(count) {}

  void OnCancel() override {
    reactor_->OnCancel();
    __tsan_release(count_);
    delete this;
  }
  void OnDone() override {
    std::fprintf(stderr, "tsan_grpc_sync: OnDone on a CancelReactor\n");
    std::abort();
  }
  bool InternalInlineable() override { return reactor_->InternalInlineable(); }

 private:
  ServerReactor* const reactor_;
  std::atomic_int* const count_;
};

}  // namespace

// OnCancel runs once on_cancel_conditions_remaining_ reaches zero: after
// the handler set up the reactor (a decrement in our inline code) and once
// the call is cancelled (a decrement inside libgrpc++'s CompletionOp, which
// TSan does not see): acquire the count's address, as for OnDone. Then
// libgrpc++ runs a (non-inlineable) reactor's OnCancel on an executor
// thread and decrements callbacks_outstanding_ itself, again invisibly;
// unless that decrement is the last, nothing would order OnCancel before
// OnDone (which typically deletes the reactor). A stand-in reactor adds
// the release right after OnCancel returns, on the thread that ran it.
void ServerCallbackCall::CallOnCancel(ServerReactor* reactor) {
  static const auto real =
      RealC<void (*)(ServerCallbackCall*, ServerReactor*)>(
          "_ZN4grpc8internal18ServerCallbackCall12CallOnCancelEPNS0_"
          "13ServerReactorE");
  __tsan_acquire(&on_cancel_conditions_remaining_);
  real(this, new CancelReactor(reactor, &callbacks_outstanding_));
}

}  // namespace internal
}  // namespace grpc
