#include "common/engine/huge_page_arena.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// The "THPeligible:" value of the /proc/self/smaps entry holding `p`, or
// -1 where the kernel does not report it.
int ThpEligible(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      in = Addr(p) >= lo && Addr(p) < hi;
      continue;
    }
    if (in && line.rfind("THPeligible:", 0) == 0) {
      return std::stoi(line.substr(12));
    }
  }
  return -1;
}

std::string ThpMode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return s;
}

TEST(HugePageArenaTest, SmallAllocationsAreZeroAlignedAndDisjoint) {
  HugePageArena& arena = HugePageArena::Default();
  std::vector<std::shared_ptr<uint8_t[]>> blocks;
  const std::vector<size_t> sizes = {1, 63, 64, 65, 4096, 100000, 0, 7};
  for (size_t n : sizes) blocks.push_back(arena.Allocate(n));
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_NE(blocks[i], nullptr);
    EXPECT_EQ(Addr(blocks[i].get()) % 64, 0u) << i;
    for (size_t j = 0; j < sizes[i]; ++j) ASSERT_EQ(blocks[i][j], 0) << i;
    // Fill with the block's index: a later check sees any overlap.
    std::fill(blocks[i].get(), blocks[i].get() + sizes[i], uint8_t(i + 1));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (size_t j = 0; j < sizes[i]; ++j) ASSERT_EQ(blocks[i][j], i + 1) << i;
  }
}

TEST(HugePageArenaTest, LargeAllocationOwnsAnAlignedMappingFreedWithIt) {
  HugePageArena& arena = HugePageArena::Default();
  const size_t before = arena.mapped_bytes();
  const size_t n = HugePageArena::kChunkBytes;  // > kChunkBytes / 4
  {
    std::shared_ptr<float[]> big = arena.AllocateArray<float>(n / 4);
    EXPECT_EQ(Addr(big.get()) % HugePageArena::kHugePageBytes, 0u);
    EXPECT_EQ(arena.mapped_bytes(), before + n);
    big[0] = 1.f;
    big[n / 4 - 1] = 2.f;
    std::shared_ptr<float[]> copy = big;  // shares the mapping
    big.reset();
    EXPECT_EQ(copy[n / 4 - 1], 2.f);
    EXPECT_EQ(arena.mapped_bytes(), before + n);
  }
  EXPECT_EQ(arena.mapped_bytes(), before);
}

TEST(HugePageArenaTest, MappingsAreAdvisedForHugePages) {
  const std::string mode = ThpMode();
  if (mode.find("[never]") != std::string::npos || mode.empty()) {
    GTEST_SKIP() << "transparent huge pages off here: " << mode;
  }
  auto big = HugePageArena::Default().Allocate(8 * HugePageArena::kHugePageBytes);
  big[0] = 1;
  const int eligible = ThpEligible(big.get());
  if (eligible < 0) GTEST_SKIP() << "kernel reports no THPeligible";
  EXPECT_EQ(eligible, 1) << "THP mode " << mode;
  auto small = HugePageArena::Default().Allocate(1000);
  small[0] = 1;
  EXPECT_EQ(ThpEligible(small.get()), 1) << "THP mode " << mode;
}

TEST(HugePageArenaTest, ConcurrentAllocationsDoNotOverlap) {
  constexpr int kThreads = 4, kPer = 200;
  std::vector<std::vector<std::shared_ptr<uint8_t[]>>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        got[t].push_back(HugePageArena::Default().Allocate(1000 + 37 * i));
        std::fill(got[t].back().get(), got[t].back().get() + 1000 + 37 * i,
                  uint8_t(t + 1));
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPer; ++i) {
      const uint8_t* p = got[t][i].get();
      for (int j = 0; j < 1000 + 37 * i; ++j) ASSERT_EQ(p[j], t + 1);
    }
  }
}

}  // namespace
}  // namespace specserve
