#include "common/engine/huge_page_arena.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace specserve {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kAlign = 64;

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

std::atomic<size_t> g_mapped{0};

}  // namespace

// One 2 MiB-aligned anonymous mapping, unmapped on destruction.
struct HugePageArena::Mapping {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (data != nullptr) {
      munmap(data, bytes);
      g_mapped.fetch_sub(bytes, std::memory_order_relaxed);
    }
  }
};

std::shared_ptr<HugePageArena::Mapping> HugePageArena::Map(size_t bytes) {
  const size_t size = RoundUp(bytes == 0 ? 1 : bytes, kPage);
  // Over-map by one huge page and trim, so the kept range starts on a
  // 2 MiB boundary (the only ranges THP can back with huge pages).
  const size_t total = size + kHugePageBytes;
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "HugePageArena: mmap of %zu bytes failed\n", total);
    std::abort();
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t start = RoundUp(base, kHugePageBytes);
  if (start > base) munmap(p, start - base);
  const uintptr_t end = start + size;
  if (base + total > end) {
    munmap(reinterpret_cast<void*>(end), base + total - end);
  }
  auto m = std::make_shared<Mapping>();
  m->data = reinterpret_cast<uint8_t*>(start);
  m->bytes = size;
  g_mapped.fetch_add(size, std::memory_order_relaxed);
  // Advice only: kernels without THP (or with it "never") keep 4 KiB
  // pages, which is correct, just slower.
  madvise(m->data, size, MADV_HUGEPAGE);
  return m;
}

HugePageArena& HugePageArena::Default() {
  static HugePageArena* arena = new HugePageArena();
  return *arena;
}

std::shared_ptr<uint8_t[]> HugePageArena::Allocate(size_t bytes) {
  if (bytes > kChunkBytes / 4) {
    std::shared_ptr<Mapping> m = Map(bytes);
    uint8_t* p = m->data;
    return std::shared_ptr<uint8_t[]>(std::move(m), p);
  }
  const size_t need = RoundUp(bytes == 0 ? 1 : bytes, kAlign);
  absl::MutexLock lock(&mu_);
  if (chunk_ == nullptr || used_ + need > chunk_->bytes) {
    chunk_ = Map(kChunkBytes);
    used_ = 0;
  }
  uint8_t* p = chunk_->data + used_;
  used_ += need;
  return std::shared_ptr<uint8_t[]>(chunk_, p);
}

size_t HugePageArena::mapped_bytes() const {
  return g_mapped.load(std::memory_order_relaxed);
}

}  // namespace specserve
