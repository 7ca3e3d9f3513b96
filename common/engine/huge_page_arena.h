#ifndef SPECSERVE_COMMON_ENGINE_HUGE_PAGE_ARENA_H_
#define SPECSERVE_COMMON_ENGINE_HUGE_PAGE_ARENA_H_

// Memory for the CPU engine's large, long-lived buffers (packed weights, KV
// planes). A decode step streams every weight once; with 4 KiB pages that
// is one TLB miss per 4 KiB, and on this project's machines the page walks
// cost ~10% of the step. Transparent huge pages in "madvise" mode (Debian's
// default) are only used for mappings advised MADV_HUGEPAGE, which plain
// operator new never does, so the buffers come from 2 MiB-aligned anonymous
// mappings advised so. Small buffers share chunks (bump allocation), so a
// model made of many sub-2 MiB matrices is still backed by huge pages.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace specserve {

/// A process-wide bump allocator over 2 MiB-aligned anonymous mappings
/// advised MADV_HUGEPAGE (Linux transparent huge pages; where the kernel
/// refuses the advice the memory is ordinary 4 KiB pages). Allocations are
/// zero-filled (fresh anonymous memory, never reused within a chunk) and
/// 64-byte aligned. A chunk is unmapped when the last allocation in it is
/// released; space freed inside a live chunk is not reused, so this is for
/// buffers that live as long as a model does. Thread-safe.
class HugePageArena {
 public:
  /// Chunk size for allocations up to kChunkBytes / 4; larger ones get a
  /// mapping of their own (rounded up to 4 KiB, so at most one partial
  /// huge page is wasted).
  static constexpr size_t kChunkBytes = size_t{64} << 20;
  static constexpr size_t kHugePageBytes = size_t{2} << 20;

  /// The engine's arena.
  static HugePageArena& Default();

  /// `bytes` zeroed bytes (bytes may be 0: a valid, unique pointer),
  /// valid while the returned pointer or a copy lives. Aborts if the
  /// address space is exhausted, like operator new.
  std::shared_ptr<uint8_t[]> Allocate(size_t bytes);

  /// Typed form: n zero-initialised T (T trivially constructible).
  template <typename T>
  std::shared_ptr<T[]> AllocateArray(size_t n) {
    std::shared_ptr<uint8_t[]> raw = Allocate(n * sizeof(T));
    T* p = reinterpret_cast<T*>(raw.get());
    return std::shared_ptr<T[]>(std::move(raw), p);
  }

  /// Bytes currently mapped by live chunks and own mappings (virtual; the
  /// resident part is what has been touched).
  size_t mapped_bytes() const;

 private:
  struct Mapping;
  static std::shared_ptr<Mapping> Map(size_t bytes);

  mutable absl::Mutex mu_;
  std::shared_ptr<Mapping> chunk_ ABSL_GUARDED_BY(mu_);
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_HUGE_PAGE_ARENA_H_
