// The emulated device (see cuda_emu.h): the block scheduler with its
// fibers and barriers, and the subset of the CUDA runtime API the project
// calls, defined here with the toolkit header's signatures so binaries
// link against this file instead of libcudart.

#include "common/cuda/emu/cuda_emu.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SPECSERVE_EMU_ASAN 1
#endif

// Fiber switch (x86-64 System V): saves the callee-saved registers and the
// stack pointer in *save_sp, loads load_sp's and returns into that fiber.
// swapcontext would do the same plus a sigprocmask system call per switch,
// which dominated the emulator's time (a shuffle is two barriers).
extern "C" void specserve_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl specserve_emu_switch
  .type specserve_emu_switch, @function
specserve_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size specserve_emu_switch, .-specserve_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace specserve {
namespace cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 << 10;  // fragments + per-thread arrays
constexpr size_t kGuardBytes = 4096;
constexpr size_t kSlotBytes = 64;          // WarpExchange bytes per lane
constexpr size_t kDefaultSmem = 48 << 10;  // without cudaFuncSetAttribute
constexpr size_t kMaxSmem = 227 << 10;     // sm_90's opt-in limit
constexpr int kSms = 132;                  // an H100 SXM

enum class Wait : uint8_t { kRunnable, kBlock, kWarp, kDone };

struct CpCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  void* sp = nullptr;     // saved stack pointer while switched out
  char* stack = nullptr;  // kStackBytes above a guard page
  uint3 tid;
  int linear = 0;
  Wait wait = Wait::kRunnable;
  unsigned mask = 0;
  std::vector<CpCopy> open;
  std::deque<std::vector<CpCopy>> groups;
};

// One block in flight, and the fibers that run its threads. Launches are
// serialized (static __shared__ arrays are shared by every block).
struct Scheduler {
  std::vector<Fiber> fibers;
  void* main_sp = nullptr;
  Fiber* current = nullptr;
  dim3 grid, block;
  uint3 block_idx;
  int threads = 0;
  std::vector<unsigned char> smem;  // + 128 for alignment
  unsigned char* smem_base = nullptr;
  std::vector<unsigned char> slots;  // threads * kSlotBytes
  size_t smem_bytes = 0;
  // Blocks, warps and the lanes of a warp run last to first: see
  // LaunchOrderReversed.
  bool reverse = false;
  const KernelBody* body = nullptr;
  const void* fn = nullptr;  // the kernel running now, for fault reports
  std::string error;
#if SPECSERVE_EMU_ASAN
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
#endif
};

Scheduler& Sched() {
  static Scheduler* s = new Scheduler;
  return *s;
}

std::mutex& LaunchMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

// --- Fibers -----------------------------------------------------------------

void ToFiber(Scheduler& s, Fiber& f) {
  s.current = &f;
#if SPECSERVE_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  specserve_emu_switch(&s.main_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  specserve_emu_switch(&s.main_sp, f.sp);
#endif
}

// From the running fiber back to the scheduler; returns when resumed.
void ToScheduler(Scheduler& s, Fiber& f, bool exiting) {
#if SPECSERVE_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, s.main_stack_bottom,
                                 s.main_stack_size);
  specserve_emu_switch(&f.sp, s.main_sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)exiting;
  specserve_emu_switch(&f.sp, s.main_sp);
#endif
}

void CompleteGroup(std::vector<CpCopy>& group) {
  for (const CpCopy& c : group) {
    if (c.valid) {
      std::memcpy(c.dst, c.src, 16);
    } else {
      std::memset(c.dst, 0, 16);
    }
  }
  group.clear();
}

void FiberMain() {
  Scheduler& s = Sched();
#if SPECSERVE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.main_stack_bottom,
                                  &s.main_stack_size);
#endif
  (*s.body)();
  Fiber& f = *s.current;
  // Copies still in flight land before the block ends.
  for (auto& g : f.groups) CompleteGroup(g);
  CompleteGroup(f.open);
  f.groups.clear();
  f.wait = Wait::kDone;
  ToScheduler(s, f, /*exiting=*/true);
  std::abort();  // never resumed
}

char* NewStack() {
  void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "cuda_emu: cannot map a fiber stack\n");
    std::abort();
  }
  mprotect(p, kGuardBytes, PROT_NONE);  // an overflow faults, not corrupts
  return static_cast<char*>(p) + kGuardBytes;
}

void Park(Wait why, unsigned mask) {
  Scheduler& s = Sched();
  Fiber& f = *s.current;
  f.wait = why;
  f.mask = mask;
  ToScheduler(s, f, /*exiting=*/false);
}

std::string Describe(const Scheduler& s) {
  int at_block = 0, at_warp = 0, done = 0;
  std::string who;
  for (int i = 0; i < s.threads; ++i) {
    const Fiber& f = s.fibers[i];
    if (f.wait == Wait::kBlock) ++at_block;
    if (f.wait == Wait::kDone) ++done;
    if (f.wait == Wait::kWarp) {
      ++at_warp;
      if (who.size() < 200) {
        who +=
            " t" + std::to_string(i) + "(mask " + std::to_string(f.mask) + ")";
      }
    }
  }
  return "block (" + std::to_string(s.block_idx.x) + "," +
         std::to_string(s.block_idx.y) + "," + std::to_string(s.block_idx.z) +
         "): " + std::to_string(at_block) + " threads at __syncthreads, " +
         std::to_string(at_warp) + " at a warp collective," + who + " " +
         std::to_string(done) + " exited";
}

// Releases the lanes of the warp at `base` whose warp collective has every
// lane of its mask waiting; the number released, or -1 (s.error set) when
// a mask names a lane that exited or does not exist.
int ReleaseWarp(Scheduler& s, int base) {
  const int lanes = std::min(32, s.threads - base);
  int waiting = 0;
  bool all_full = true;
  for (int l = 0; l < lanes; ++l) {
    const Fiber& f = s.fibers[base + l];
    if (f.wait == Wait::kWarp) {
      ++waiting;
      all_full &= f.mask == 0xffffffffu;
    }
  }
  if (waiting == 0) return 0;
  if (waiting == 32 && all_full) {  // the common case: the whole warp
    for (int l = 0; l < 32; ++l) s.fibers[base + l].wait = Wait::kRunnable;
    return 32;
  }
  int ready_lanes[32], n = 0;
  for (int l0 = 0; l0 < lanes; ++l0) {
    const Fiber& f = s.fibers[base + l0];
    if (f.wait != Wait::kWarp) continue;
    bool ready = true;
    for (int l = 0; l < 32 && ready; ++l) {
      if (((f.mask >> l) & 1u) == 0) continue;
      if (base + l >= s.threads) {
        s.error = "a warp collective's mask names lane " + std::to_string(l) +
                  ", which the block does not have";
        return -1;
      }
      const Wait w = s.fibers[base + l].wait;
      if (w == Wait::kDone) {
        s.error = "thread " + std::to_string(base + l0) +
                  " waits in a warp collective for lane " + std::to_string(l) +
                  ", which has exited";
        return -1;
      }
      ready = w == Wait::kWarp;
    }
    if (ready) ready_lanes[n++] = base + l0;
  }
  for (int k = 0; k < n; ++k) s.fibers[ready_lanes[k]].wait = Wait::kRunnable;
  return n;
}

// Runs the current block to completion; false (s.error set) on a kernel
// error or a barrier that can never complete. Warp by warp: a warp's lanes
// run until each waits (or exits), its warp collectives are released and
// it runs on, until it reaches __syncthreads or ends; then the next warp
// (warps and lanes last to first when s.reverse).
bool RunBlock(Scheduler& s) {
  for (int i = 0; i < s.threads; ++i) {
    Fiber& f = s.fibers[i];
    if (f.stack == nullptr) f.stack = NewStack();
#if SPECSERVE_EMU_ASAN
    // The last block's fibers never returned: their frames' poison stays.
    __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
    // A fresh stack for specserve_emu_switch: six zeroed registers, then
    // FiberMain as the return address, entered with the stack aligned as
    // after a call (rsp = 8 mod 16).
    void** top = reinterpret_cast<void**>(f.stack + kStackBytes);
    top[-1] = nullptr;
    top[-2] = reinterpret_cast<void*>(&FiberMain);
    for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
    f.sp = top - 8;
    f.linear = i;
    f.tid = make_uint3(i % s.block.x, (i / s.block.x) % s.block.y,
                       i / (s.block.x * s.block.y));
    f.wait = Wait::kRunnable;
    f.open.clear();
    f.groups.clear();
  }
  const int warps = (s.threads + 31) / 32;
  while (true) {
    for (int w = 0; w < warps; ++w) {
      const int base = 32 * (s.reverse ? warps - 1 - w : w);
      const int end = std::min(base + 32, s.threads);
      while (true) {
        for (int k = 0; k < end - base; ++k) {
          const int i = s.reverse ? end - 1 - k : base + k;
          if (s.fibers[i].wait == Wait::kRunnable) ToFiber(s, s.fibers[i]);
          if (!s.error.empty()) return false;
        }
        const int released = ReleaseWarp(s, base);
        if (released < 0) return false;
        if (released == 0) break;
      }
    }
    int done = 0, at_block = 0;
    for (int i = 0; i < s.threads; ++i) {
      done += s.fibers[i].wait == Wait::kDone;
      at_block += s.fibers[i].wait == Wait::kBlock;
    }
    if (done == s.threads) return true;
    if (at_block > 0 && at_block + done == s.threads) {
      for (int i = 0; i < s.threads; ++i) {
        if (s.fibers[i].wait == Wait::kBlock) {
          s.fibers[i].wait = Wait::kRunnable;
        }
      }
      continue;
    }
    s.error = "deadlock: " + Describe(s);
    return false;
  }
}

// --- Runtime state
// ------------------------------------------------------------

thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t SetError(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

struct Graph {
  std::vector<std::function<void()>> ops;
};

struct Stream {
  Graph* capture = nullptr;  // non-null while capturing
  bool invalidated = false;
};

// One cudaMalloc: its own mapping, the span placed at the mapping's end
// against a PROT_NONE guard page, so a kernel reading or writing past the
// 256-byte-rounded end faults at once (an illegal address on a device,
// reported by OnSegv) instead of touching a neighbour; the rounding slack
// between `bytes` and the guard keeps its 0xff fill unless something writes
// past the end (CheckSlack).
struct Allocation {
  size_t bytes = 0;      // asked for
  size_t rounded = 0;    // bytes rounded up to 256 (at least 256)
  void* map = nullptr;   // the mapping: data pages, then the guard page
  size_t map_bytes = 0;
};

constexpr size_t kPageBytes = 4096;

struct Runtime {
  std::mutex mu;
  std::map<uintptr_t, Allocation> allocations;  // by start
  size_t allocated = 0;
  size_t total = 0;
  std::map<const void*, size_t> max_dynamic_smem;
  Stream default_stream;
  std::vector<Stream*> capturing;    // streams now capturing
  cudaError_t sticky = cudaSuccess;  // a failed kernel, as on a device
};

Runtime& Rt() {
  static Runtime* r = [] {
    auto* r = new Runtime;
    const char* env = std::getenv("SPECSERVE_CUDA_EMU_MEMORY_BYTES");
    r->total =
        env != nullptr ? std::strtoull(env, nullptr, 10) : (size_t{2} << 30);
    return r;
  }();
  return *r;
}

Stream* StreamOf(cudaStream_t s) {
  // 0, cudaStreamLegacy (0x1) and cudaStreamPerThread (0x2): the default.
  if (reinterpret_cast<uintptr_t>(s) <= 2) return &Rt().default_stream;
  return reinterpret_cast<Stream*>(s);
}

// A call CUDA forbids while this thread captures (cudaStreamCaptureMode
// Global / ThreadLocal): it fails and invalidates the capture.
cudaError_t CheckNotCapturing() {
  Runtime& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  if (r.capturing.empty()) return cudaSuccess;
  for (Stream* s : r.capturing) s->invalidated = true;
  return SetError(cudaErrorStreamCaptureUnsupported);
}

// Runs `op` now, or appends it to the graph `stream` is capturing.
void Enqueue(cudaStream_t stream, std::function<void()> op) {
  Stream* s = StreamOf(stream);
  if (s->capture != nullptr) {
    s->capture->ops.push_back(std::move(op));
    return;
  }
  op();
}

// True when [p, p + bytes) lies inside one allocation.
bool IsDeviceRange(const void* p, size_t bytes) {
  Runtime& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = r.allocations.upper_bound(a);
  if (it == r.allocations.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second.bytes;
}

// The first allocation whose rounding slack no longer holds its 0xff fill:
// something wrote past its end. Empty when none. The slack is refilled, so
// each such write is reported once.
std::string CheckSlack() {
  Runtime& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  for (const auto& [start, a] : r.allocations) {
    auto* p = reinterpret_cast<unsigned char*>(start);
    for (size_t i = a.bytes; i < a.rounded; ++i) {
      if (p[i] != 0xff) {
        std::memset(p + a.bytes, 0xff, a.rounded - a.bytes);
        return "a write " + std::to_string(i - a.bytes) +
               " bytes past the end of a " + std::to_string(a.bytes) +
               "-byte allocation";
      }
    }
  }
  return "";
}

// SIGSEGV on an allocation's guard page: says which allocation and, inside
// a launch, which kernel, block and thread; then the previous handler (or
// the default crash) takes the fault. Not async-signal-safe in general; it
// runs only on the way to a crash.
struct sigaction g_previous_segv;

void OnSegv(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (const auto& [start, a] : Rt().allocations) {  // no lock: crashing
    const uintptr_t guard =
        reinterpret_cast<uintptr_t>(a.map) + a.map_bytes - kPageBytes;
    if (at < guard || at >= guard + kPageBytes) continue;
    char msg[320];
    const Scheduler& s = Sched();
    int n = std::snprintf(msg, sizeof(msg),
                          "cuda_emu: illegal address: byte %zu of a "
                          "%zu-byte device allocation (past its end)",
                          static_cast<size_t>(at - start), a.bytes);
    if (s.current != nullptr && n > 0 && n < static_cast<int>(sizeof(msg))) {
      n += std::snprintf(msg + n, sizeof(msg) - n,
                         " in kernel %p, block (%u,%u,%u), thread %d", s.fn,
                         s.block_idx.x, s.block_idx.y, s.block_idx.z,
                         s.current->linear);
    }
    if (n > 0 && n < static_cast<int>(sizeof(msg)) - 1) msg[n++] = '\n';
    if (n > 0) (void)!write(2, msg, std::min<size_t>(n, sizeof(msg)));
    break;
  }
  // Returning re-runs the access under the previous handler.
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
  (void)sig;
  (void)context;
}

void InstallSegvReport() {
  static const bool installed = [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = &OnSegv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    return true;
  }();
  (void)installed;
}

bool IsDevicePointer(const void* p) { return IsDeviceRange(p, 1); }

// A copy's device side(s) against the allocations: `dst_bytes` from dst and
// `src_bytes` from src must each lie inside one allocation where `kind`
// says that side is on the device.
cudaError_t CheckCopy(void* dst, size_t dst_bytes, const void* src,
                      size_t src_bytes, cudaMemcpyKind kind) {
  if (dst_bytes == 0 && src_bytes == 0) return cudaSuccess;
  const bool dst_dev = kind == cudaMemcpyHostToDevice ||
                       kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && IsDevicePointer(dst));
  const bool src_dev = kind == cudaMemcpyDeviceToHost ||
                       kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && IsDevicePointer(src));
  if (dst_dev && !IsDeviceRange(dst, dst_bytes)) {
    std::fprintf(stderr,
                 "cuda_emu: copy of %zu bytes to %p leaves device memory\n",
                 dst_bytes, dst);
    return cudaErrorInvalidValue;
  }
  if (src_dev && !IsDeviceRange(src, src_bytes)) {
    std::fprintf(stderr,
                 "cuda_emu: copy of %zu bytes from %p leaves device memory\n",
                 src_bytes, src);
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t CheckCopy(void* dst, const void* src, size_t bytes,
                      cudaMemcpyKind kind) {
  return CheckCopy(dst, bytes, src, bytes, kind);
}

// Whether this launch runs its blocks, the warps of a block and the lanes
// of a warp last to first. A device promises no order among them, so a
// kernel that reads what another thread wrote without a barrier between
// them (a race) gets the stale value in one of the two orders. By
// SPECSERVE_CUDA_EMU_ORDER: "forward", "reverse", or "alternate" (the
// default: launches alternate, so each kernel of a test runs both ways).
bool LaunchOrderReversed() {
  static const int mode = [] {
    const char* env = std::getenv("SPECSERVE_CUDA_EMU_ORDER");
    const std::string m = env == nullptr ? "alternate" : env;
    if (m == "forward") return 0;
    if (m == "reverse") return 1;
    if (m != "alternate") {
      std::fprintf(stderr,
                   "cuda_emu: SPECSERVE_CUDA_EMU_ORDER=%s is not forward, "
                   "reverse or alternate; alternating\n",
                   m.c_str());
    }
    return 2;
  }();
  static uint64_t launches = 0;  // under LaunchMutex
  return mode == 2 ? (launches++ & 1) != 0 : mode == 1;
}

void RunGrid(const void* fn, dim3 grid, dim3 block, size_t smem_bytes,
             const KernelBody& body) {
  std::lock_guard<std::mutex> l(LaunchMutex());
  Scheduler& s = Sched();
  s.grid = grid;
  s.block = block;
  s.threads = static_cast<int>(block.x * block.y * block.z);
  if (s.fibers.size() < static_cast<size_t>(s.threads)) {
    s.fibers.resize(s.threads);
  }
  s.smem.resize(smem_bytes + 128);
  s.smem_bytes = smem_bytes;
  s.smem_base = s.smem.data() +
                (128 - reinterpret_cast<uintptr_t>(s.smem.data()) % 128) % 128;
  s.slots.assign(static_cast<size_t>(s.threads) * kSlotBytes, 0);
  s.body = &body;
  s.fn = fn;
  s.error.clear();
  s.reverse = LaunchOrderReversed();
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  for (uint64_t n = 0; n < blocks; ++n) {
    const uint64_t b = s.reverse ? blocks - 1 - n : n;
    s.block_idx = make_uint3(b % grid.x, (b / grid.x) % grid.y,
                             b / (uint64_t{grid.x} * grid.y));
    // Each block's dynamic shared memory starts uninitialized (0xff bytes:
    // NaN as floats), not holding the last block's values.
    std::memset(s.smem_base, 0xff, s.smem_bytes);
    if (!RunBlock(s)) {
      std::fprintf(stderr, "cuda_emu: kernel %p failed: %s\n", fn,
                   s.error.c_str());
      SetError(cudaErrorLaunchFailure);
      Rt().sticky = cudaErrorLaunchFailure;
      s.current = nullptr;
      return;
    }
  }
  s.current = nullptr;
  if (const std::string slack = CheckSlack(); !slack.empty()) {
    std::fprintf(stderr, "cuda_emu: kernel %p: illegal address: %s\n", fn,
                 slack.c_str());
    SetError(cudaErrorIllegalAddress);
    Rt().sticky = cudaErrorIllegalAddress;
  }
}

}  // namespace

// --- Kernel-side API
// ------------------------------------------------------------

uint3 ThreadIdx() { return Sched().current->tid; }
uint3 BlockIdx() { return Sched().block_idx; }
dim3 BlockDim() { return Sched().block; }
dim3 GridDim() { return Sched().grid; }
int LinearThreadIdx() { return Sched().current->linear; }

void SyncThreads() { Park(Wait::kBlock, 0); }

void SyncWarp(unsigned mask) { Park(Wait::kWarp, mask); }

void WarpExchange(const void* mine, void* all, size_t bytes, unsigned mask) {
  Scheduler& s = Sched();
  if (bytes > kSlotBytes) {
    KernelError("WarpExchange of more than 64 bytes per lane");
    return;
  }
  const int i = s.current->linear, base = i & ~31;
  std::memcpy(&s.slots[static_cast<size_t>(i) * kSlotBytes], mine, bytes);
  SyncWarp(mask);
  auto* out = static_cast<unsigned char*>(all);
  for (int l = 0; l < 32; ++l) {
    if (((mask >> l) & 1u) != 0 && base + l < s.threads) {
      std::memcpy(out + l * bytes,
                  &s.slots[static_cast<size_t>(base + l) * kSlotBytes], bytes);
    } else {
      std::memset(out + l * bytes, 0, bytes);
    }
  }
  SyncWarp(mask);  // nobody overwrites a slot before every lane read it
}

void KernelError(const char* what) {
  Scheduler& s = Sched();
  if (s.error.empty()) {
    s.error = std::string(what) + " (thread " +
              std::to_string(s.current->linear) + ")";
  }
}

unsigned char* DynamicShared() { return Sched().smem_base; }

void CpAsyncQueue(void* dst, const void* src, bool valid) {
  Sched().current->open.push_back({dst, src, valid});
}

void CpAsyncCommitGroup() {
  Fiber& f = *Sched().current;
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void CpAsyncWaitGroup(int pending) {
  Fiber& f = *Sched().current;
  while (static_cast<int>(f.groups.size()) > pending) {
    CompleteGroup(f.groups.front());
    f.groups.pop_front();
  }
}

void Submit(cudaStream_t stream, const void* fn, dim3 grid, dim3 block,
            size_t dynamic_smem, KernelBody body) {
  const unsigned long long threads =
      static_cast<unsigned long long>(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    std::fprintf(stderr,
                 "cuda_emu: invalid launch: grid (%u,%u,%u), block "
                 "(%u,%u,%u)\n",
                 grid.x, grid.y, grid.z, block.x, block.y, block.z);
    SetError(cudaErrorInvalidConfiguration);
    return;
  }
  size_t limit = kDefaultSmem;
  {
    Runtime& r = Rt();
    std::lock_guard<std::mutex> l(r.mu);
    auto it = r.max_dynamic_smem.find(fn);
    if (it != r.max_dynamic_smem.end()) limit = it->second;
  }
  if (dynamic_smem > limit) {
    std::fprintf(stderr,
                 "cuda_emu: launch asks for %zu bytes of dynamic shared "
                 "memory; the kernel allows %zu (cudaFuncSetAttribute)\n",
                 dynamic_smem, limit);
    SetError(cudaErrorInvalidValue);
    return;
  }
  Enqueue(stream, [fn, grid, block, dynamic_smem, body = std::move(body)] {
    RunGrid(fn, grid, block, dynamic_smem, body);
  });
}

void EnqueueOnStream(cudaStream_t stream, std::function<void()> op) {
  Enqueue(stream, std::move(op));
}

}  // namespace cuda_emu
}  // namespace specserve

// --- The CUDA runtime API
// -------------------------------------------------------

using specserve::cuda_emu::CheckCopy;
using specserve::cuda_emu::CheckNotCapturing;
using specserve::cuda_emu::Enqueue;
using specserve::cuda_emu::IsDeviceRange;
using specserve::cuda_emu::Rt;
using specserve::cuda_emu::SetError;
using specserve::cuda_emu::StreamOf;
namespace emu = specserve::cuda_emu;

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = emu::t_last_error;
  emu::t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return emu::t_last_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (emulated kernel failed; see "
             "stderr)";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered (emulated; see "
             "stderr)";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    default:
      return cudaGetErrorName(e);
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : SetError(cudaErrorInvalidDevice);
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device != 0) return SetError(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "specserve CUDA emulator (CPU)");
  p->totalGlobalMem = Rt().total;
  p->sharedMemPerBlock = emu::kDefaultSmem;
  p->sharedMemPerBlockOptin = emu::kMaxSmem;
  p->sharedMemPerMultiprocessor = 228 << 10;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = emu::kSms;
  p->l2CacheSize = 50 << 20;
  p->maxThreadsPerMultiProcessor = 2048;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                   int device) {
  if (device != 0) return SetError(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = emu::kSms;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(emu::kMaxSmem);
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(emu::kDefaultSmem);
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      break;
    case cudaDevAttrWarpSize:
      *value = 32;
      break;
    case cudaDevAttrL2CacheSize:
      *value = 50 << 20;
      break;
    default:
      return SetError(cudaErrorNotSupported);
  }
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  auto& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  *free_bytes = r.total - r.allocated;
  *total_bytes = r.total;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  if (cudaError_t e = CheckNotCapturing(); e != cudaSuccess) return e;
  auto& r = Rt();
  const size_t rounded = std::max<size_t>((bytes + 255) / 256 * 256, 256);
  {
    std::lock_guard<std::mutex> l(r.mu);
    if (r.allocated + rounded > r.total) {
      return SetError(cudaErrorMemoryAllocation);
    }
    r.allocated += rounded;
  }
  emu::InstallSegvReport();
  emu::Allocation a;
  a.bytes = bytes;
  a.rounded = rounded;
  const size_t data = (rounded + emu::kPageBytes - 1) / emu::kPageBytes *
                      emu::kPageBytes;
  a.map_bytes = data + emu::kPageBytes;
  a.map = mmap(nullptr, a.map_bytes, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (a.map == MAP_FAILED) {
    std::lock_guard<std::mutex> l(r.mu);
    r.allocated -= rounded;
    return SetError(cudaErrorMemoryAllocation);
  }
  char* base = static_cast<char*>(a.map);
  mprotect(base + data, emu::kPageBytes, PROT_NONE);
  // 256-byte aligned: data is whole pages and rounded a multiple of 256.
  char* mem = base + data - rounded;
  std::memset(mem, 0xff, rounded);  // NaN as fp32: a read before a write shows
  std::lock_guard<std::mutex> l(r.mu);
  r.allocations[reinterpret_cast<uintptr_t>(mem)] = a;
  *p = mem;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  auto& r = Rt();
  void* map = nullptr;
  size_t map_bytes = 0;
  {
    std::lock_guard<std::mutex> l(r.mu);
    auto it = r.allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it == r.allocations.end()) return SetError(cudaErrorInvalidValue);
    r.allocated -= it->second.rounded;
    map = it->second.map;
    map_bytes = it->second.map_bytes;
    r.allocations.erase(it);
  }
  munmap(map, map_bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src,
                         size_t spitch, size_t width, size_t height,
                         cudaMemcpyKind kind) {
  if (cudaError_t e = CheckNotCapturing(); e != cudaSuccess) return e;
  if (Rt().sticky != cudaSuccess) return Rt().sticky;
  if (width > dpitch || width > spitch) return SetError(cudaErrorInvalidValue);
  if (height == 0 || width == 0) return cudaSuccess;
  if (cudaError_t e = CheckCopy(dst, dpitch * (height - 1) + width, src,
                                spitch * (height - 1) + width, kind);
      e != cudaSuccess) {
    return SetError(e);
  }
  for (size_t r = 0; r < height; ++r) {
    std::memmove(static_cast<char*>(dst) + r * dpitch,
                 static_cast<const char*>(src) + r * spitch, width);
  }
  return cudaSuccess;
}

// One row of cudaMemcpy2D.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind) {
  return cudaMemcpy2D(dst, bytes, src, bytes, bytes, 1, kind);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t stream) {
  if (cudaError_t e = CheckCopy(dst, src, bytes, kind); e != cudaSuccess) {
    return SetError(e);
  }
  if (bytes > 0) Enqueue(stream, [=] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes,
                            cudaStream_t stream) {
  if (bytes > 0 && !IsDeviceRange(dst, bytes)) {
    return SetError(cudaErrorInvalidValue);
  }
  if (bytes > 0) Enqueue(stream, [=] { std::memset(dst, value, bytes); });
  return cudaSuccess;
}

// On the default stream, which never captures: it runs now.
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (cudaError_t e = CheckNotCapturing(); e != cudaSuccess) return e;
  return cudaMemsetAsync(dst, value, bytes, nullptr);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (cudaError_t e = CheckNotCapturing(); e != cudaSuccess) return e;
  return Rt().sticky;
}

// Clears the sticky error of a failed kernel (a device's reset destroys its
// context; allocations here stay valid).
cudaError_t cudaDeviceReset(void) {
  Rt().sticky = cudaSuccess;
  emu::t_last_error = cudaSuccess;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (StreamOf(stream)->capture != nullptr) {
    StreamOf(stream)->invalidated = true;
    return SetError(cudaErrorStreamCaptureUnsupported);
  }
  return Rt().sticky;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = reinterpret_cast<cudaStream_t>(new emu::Stream);
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  return cudaStreamCreate(stream);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(stream) <= 2) {
    return SetError(cudaErrorInvalidValue);
  }
  delete reinterpret_cast<emu::Stream*>(stream);
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr,
                                 int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    return cudaSuccess;
  }
  if (value < 0 || static_cast<size_t>(value) > emu::kMaxSmem) {
    return SetError(cudaErrorInvalidValue);
  }
  auto& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  r.max_dynamic_smem[fn] = static_cast<size_t>(value);
  return cudaSuccess;
}

// Events hold the host time at which the stream reached them.
struct EmuEvent {
  std::chrono::steady_clock::time_point at;
};

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new EmuEvent);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<EmuEvent*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto* e = reinterpret_cast<EmuEvent*>(event);
  Enqueue(stream, [e] { e->at = std::chrono::steady_clock::now(); });
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return Rt().sticky; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                 cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(
            reinterpret_cast<EmuEvent*>(end)->at -
            reinterpret_cast<EmuEvent*>(start)->at)
            .count();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  emu::Stream* s = StreamOf(stream);
  if (s == &Rt().default_stream || s->capture != nullptr) {
    return SetError(cudaErrorIllegalState);
  }
  s->capture = new emu::Graph;
  s->invalidated = false;
  auto& r = Rt();
  std::lock_guard<std::mutex> l(r.mu);
  r.capturing.push_back(s);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  emu::Stream* s = StreamOf(stream);
  if (s->capture == nullptr) return SetError(cudaErrorIllegalState);
  {
    auto& r = Rt();
    std::lock_guard<std::mutex> l(r.mu);
    r.capturing.erase(std::remove(r.capturing.begin(), r.capturing.end(), s),
                      r.capturing.end());
  }
  emu::Graph* g = s->capture;
  s->capture = nullptr;
  if (s->invalidated) {
    delete g;
    *graph = nullptr;
    return SetError(cudaErrorStreamCaptureInvalidated);
  }
  *graph = reinterpret_cast<cudaGraph_t>(g);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                  cudaStreamCaptureStatus* status) {
  *status = StreamOf(stream)->capture != nullptr ? cudaStreamCaptureStatusActive
                                                 : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long) {
  if (graph == nullptr) return SetError(cudaErrorInvalidValue);
  auto* copy = new emu::Graph(*reinterpret_cast<emu::Graph*>(graph));
  *exec = reinterpret_cast<cudaGraphExec_t>(copy);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return SetError(cudaErrorInvalidValue);
  const emu::Graph* g = reinterpret_cast<const emu::Graph*>(exec);
  Enqueue(stream, [g] {
    for (const auto& op : g->ops) op();
  });
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete reinterpret_cast<emu::Graph*>(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<emu::Graph*>(graph);
  return cudaSuccess;
}

}  // extern "C"
