// cuda_kernels::FlashMmaAttention (flash_mma.cu):
// - argument checks (run everywhere: they precede any CUDA call);
// - agreement with a float64 host reference of paged causal grouped-query
//   attention (inputs rounded to bf16 / fp16 on the host exactly as the
//   device stores them; K and V scattered into a paged pool through a
//   shuffled block table whose unused rows hold NaN, so a read of a wrong
//   row shows), over full prefills (first = 0), chunks after cached keys,
//   GQA groups of 4, 2 and 1, head_dim 64 and 128, bf16 and fp16, lengths
//   that are not tile multiples, block sizes 16 and 1 and a contiguous
//   cache;
// - agreement with the WMMA kernel cuda_kernels::FlashAttention on the same
//   inputs;
// - a timing report of both kernels at n = 4096 and 16384 (prints only).
// GPU tests skip where no CUDA device is present.

#include "common/cuda/flash_mma.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_format.h"
#include "common/cuda/device.h"
#include "common/cuda/device_array_test_util.h"
#include "common/cuda/kernels.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;

// ---------------------------------------------------------------------------
// Host 16-bit formats (round to nearest even), the device's storage.
// ---------------------------------------------------------------------------
uint16_t ToBf16(float f) {
  const uint32_t u = absl::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Finite inputs well inside the fp16 range (|f| < 65504).
uint16_t ToFp16(float f) {
  const uint32_t u = absl::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const float a = std::fabs(f);
  if (a < 6.103515625e-05f) {  // below 2^-14: subnormal, units of 2^-24
    return static_cast<uint16_t>(
        sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t x = u & 0x7FFFFFFFu;
  uint32_t h = ((((x >> 23) - 127 + 15) << 10) | ((x & 0x7FFFFFu) >> 13));
  const uint32_t rem = x & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float FromBf16(uint16_t b) {
  return absl::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

float FromFp16(uint16_t b) {
  const uint32_t sign = (b & 0x8000u) << 16;
  const uint32_t e = (b >> 10) & 0x1Fu, m = b & 0x3FFu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return absl::bit_cast<float>(sign | 0x7F800000u | (m << 13));
  return absl::bit_cast<float>(sign | ((e - 15 + 127) << 23) | (m << 13));
}

uint16_t ToBits(float f, CudaDType dtype) {
  return dtype == CudaDType::kBF16 ? ToBf16(f) : ToFp16(f);
}
float FromBits(uint16_t b, CudaDType dtype) {
  return dtype == CudaDType::kBF16 ? FromBf16(b) : FromFp16(b);
}

using testing_cuda::DeviceArray;

// ---------------------------------------------------------------------------
// Test problems.
// ---------------------------------------------------------------------------
struct Case {
  CudaDType dtype = CudaDType::kBF16;
  int head_dim = 64;
  int num_heads = 8;
  int num_kv_heads = 8;
  int n = 1;
  int first = 0;
  int block_size = 16;   // 0: contiguous cache (no block table)
  float q_range = 2.0f;  // q ~ U(-q_range, q_range); k, v ~ U(-1, 1)
};

std::string CaseName(const Case& c) {
  std::string name =
      absl::StrFormat("%s_d%d_h%dkv%d_n%d_first%d_", CudaDTypeName(c.dtype),
                      c.head_dim, c.num_heads, c.num_kv_heads, c.n, c.first);
  name += c.block_size == 0 ? std::string("contiguous")
                            : absl::StrFormat("bs%d", c.block_size);
  if (c.q_range > 4.0f) name += "_peaky";
  return name;
}

// Inputs as the device holds them (16-bit bits) plus their exact values.
struct Problem {
  Case c;
  std::vector<uint16_t> q;               // [n, H, D]
  std::vector<float> qv;                 // decoded q
  std::vector<float> kv_k, kv_v;         // logical [first + n, KV, D], decoded
  std::vector<uint16_t> pool_k, pool_v;  // [pool rows, KV, D]
  std::vector<int> block_table;          // empty: contiguous
};

Problem MakeProblem(const Case& c, uint32_t seed) {
  Problem p;
  p.c = c;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uq(-c.q_range, c.q_range);
  std::uniform_real_distribution<float> ukv(-1.0f, 1.0f);
  const int D = c.head_dim, H = c.num_heads, KV = c.num_kv_heads;
  const int total = c.first + c.n;
  const size_t row = static_cast<size_t>(KV) * D;
  p.q.resize(static_cast<size_t>(c.n) * H * D);
  p.qv.resize(p.q.size());
  for (size_t i = 0; i < p.q.size(); ++i) {
    p.q[i] = ToBits(uq(rng), c.dtype);
    p.qv[i] = FromBits(p.q[i], c.dtype);
  }
  std::vector<uint16_t> k_bits(total * row), v_bits(total * row);
  p.kv_k.resize(total * row);
  p.kv_v.resize(total * row);
  for (size_t i = 0; i < k_bits.size(); ++i) {
    k_bits[i] = ToBits(ukv(rng), c.dtype);
    v_bits[i] = ToBits(ukv(rng), c.dtype);
    p.kv_k[i] = FromBits(k_bits[i], c.dtype);
    p.kv_v[i] = FromBits(v_bits[i], c.dtype);
  }
  if (c.block_size == 0) {
    p.pool_k = k_bits;
    p.pool_v = v_bits;
    return p;
  }
  // Paged: the logical blocks in a shuffled order among a few spare blocks
  // whose rows hold NaN (0xFFFF in both formats).
  const int bs = c.block_size;
  const int blocks = (total + bs - 1) / bs;
  const int pool_blocks = blocks + 3;
  std::vector<int> perm(pool_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  p.block_table.assign(perm.begin(), perm.begin() + blocks);
  p.pool_k.assign(static_cast<size_t>(pool_blocks) * bs * row, 0xFFFF);
  p.pool_v.assign(p.pool_k.size(), 0xFFFF);
  for (int t = 0; t < total; ++t) {
    const size_t phys =
        static_cast<size_t>(p.block_table[t / bs]) * bs + t % bs;
    std::copy_n(k_bits.begin() + t * row, row, p.pool_k.begin() + phys * row);
    std::copy_n(v_bits.begin() + t * row, row, p.pool_v.begin() + phys * row);
  }
  return p;
}

float Scale(const Case& c) { return 1.0f / std::sqrt(float(c.head_dim)); }

// float64 causal GQA attention: out [n, H * D].
std::vector<double> Reference(const Problem& p) {
  const Case& c = p.c;
  const int D = c.head_dim, H = c.num_heads, KV = c.num_kv_heads;
  const int group = H / KV;
  const double scale = Scale(c);
  std::vector<double> out(static_cast<size_t>(c.n) * H * D, 0.0);
  std::vector<double> logits;
  for (int i = 0; i < c.n; ++i) {
    const int keys = c.first + i + 1;
    logits.resize(keys);
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qr = &p.qv[(static_cast<size_t>(i) * H + h) * D];
      double mx = -INFINITY;
      for (int j = 0; j < keys; ++j) {
        const float* kr = &p.kv_k[(static_cast<size_t>(j) * KV + g) * D];
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += double(qr[d]) * kr[d];
        logits[j] = dot * scale;
        mx = std::max(mx, logits[j]);
      }
      double sum = 0.0;
      for (int j = 0; j < keys; ++j) {
        logits[j] = std::exp(logits[j] - mx);
        sum += logits[j];
      }
      double* o = &out[(static_cast<size_t>(i) * H + h) * D];
      for (int j = 0; j < keys; ++j) {
        const float* vr = &p.kv_v[(static_cast<size_t>(j) * KV + g) * D];
        const double w = logits[j] / sum;
        for (int d = 0; d < D; ++d) o[d] += w * vr[d];
      }
    }
  }
  return out;
}

using Kernel = cudaError_t (*)(const ck::AttentionArgs&, cudaStream_t);

// Runs `kernel` on the problem; *out gets the decoded output. The output is
// poisoned first (NaN bits), so a row the kernel skips fails.
void RunKernel(const Problem& p, Kernel kernel, std::vector<float>* out) {
  const Case& c = p.c;
  DeviceArray d_q(p.q.size() * 2), d_k(p.pool_k.size() * 2),
      d_v(p.pool_v.size() * 2), d_out(p.q.size() * 2),
      d_table(p.block_table.size() * sizeof(int));
  ASSERT_CUDA_OK(d_q.Upload(p.q));
  ASSERT_CUDA_OK(d_k.Upload(p.pool_k));
  ASSERT_CUDA_OK(d_v.Upload(p.pool_v));
  ASSERT_CUDA_OK(d_table.Upload(p.block_table));
  std::vector<uint16_t> out_bits(p.q.size(), 0xFFFF);
  ASSERT_CUDA_OK(d_out.Upload(out_bits));
  ck::AttentionArgs a;
  a.q = d_q.get();
  a.k_cache = d_k.get();
  a.v_cache = d_v.get();
  a.out = d_out.get();
  a.dtype = c.dtype;
  a.n = c.n;
  a.first = c.first;
  a.num_heads = c.num_heads;
  a.num_kv_heads = c.num_kv_heads;
  a.head_dim = c.head_dim;
  a.scale = Scale(c);
  if (c.block_size > 0) {
    a.block_table = static_cast<const int*>(d_table.get());
    a.block_size = c.block_size;
  }
  ASSERT_CUDA_OK(kernel(a, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(d_out.Download(&out_bits));
  out->resize(out_bits.size());
  for (size_t i = 0; i < out_bits.size(); ++i) {
    (*out)[i] = FromBits(out_bits[i], c.dtype);
  }
}

// |got - want| <= rel * (|want| + 0.5) everywhere (rel = 1e-2 against the
// reference): the output's and P's rounding to 16 bits are ~2^-9 relative
// (bf16); values are O(1) averages of v in [-1, 1]. Reports the first few
// failures and the largest error.
void ExpectClose(const Case& c, const std::vector<float>& got,
                 const std::vector<double>& want, double rel,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  const int HD = c.num_heads * c.head_dim;
  int bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    const bool ok = err <= rel * (std::fabs(want[i]) + 0.5);  // false on NaN
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << what << " " << CaseName(c) << ": row " << i / HD
                    << " head " << (i % HD) / c.head_dim << " dim "
                    << i % c.head_dim << ": got " << got[i] << ", want "
                    << want[i];
    }
    worst = std::isnan(err) ? INFINITY : std::max(worst, err);
  }
  EXPECT_EQ(bad, 0) << what << " " << CaseName(c) << ": " << bad
                    << " elements out of tolerance, max error " << worst;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (CudaDType dtype : {CudaDType::kBF16, CudaDType::kFP16}) {
    for (int d : {64, 128}) {
      auto add = [&](int h, int kv, int n, int first, int bs,
                     float q_range = 2.0f) {
        Case c;
        c.dtype = dtype;
        c.head_dim = d;
        c.num_heads = h;
        c.num_kv_heads = kv;
        c.n = n;
        c.first = first;
        c.block_size = bs;
        c.q_range = q_range;
        cases.push_back(c);
      };
      add(32, 8, 257, 0, 16);    // full prefill, GQA 4
      add(16, 8, 100, 300, 16);  // chunk after cached keys, GQA 2
      add(8, 8, 17, 5, 1);       // MHA, block size 1
      add(32, 8, 1, 300, 1);     // one row
      add(16, 8, 64, 0, 1);      // exactly one tile
      add(8, 8, 130, 64, 16);    // first on a tile boundary
      add(16, 8, 100, 37, 0);    // contiguous cache
      add(8, 2, 65, 63, 16);     // GQA 4 over 2 kv heads, rows straddle tiles
      add(8, 8, 64, 5, 16, 12.0f);  // peaky softmax: max moves across tiles
    }
  }
  return cases;
}

class FlashMmaTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
  }
};

TEST_P(FlashMmaTest, MatchesHostReference) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 1234 + c.n * 7 + c.first);
  std::vector<float> got;
  RunKernel(p, &ck::FlashMmaAttention, &got);
  if (HasFatalFailure()) return;
  ExpectClose(c, got, Reference(p), 1e-2, "FlashMmaAttention");
}

TEST_P(FlashMmaTest, AgreesWithFlashAttention) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c, 99 + c.n * 3 + c.first);
  std::vector<float> mma, wmma;
  RunKernel(p, &ck::FlashMmaAttention, &mma);
  if (HasFatalFailure()) return;
  RunKernel(p, &ck::FlashAttention, &wmma);
  if (HasFatalFailure()) return;
  const std::vector<double> ref = Reference(p);
  ExpectClose(c, wmma, ref, 1e-2, "FlashAttention");
  ExpectClose(c, mma, std::vector<double>(wmma.begin(), wmma.end()), 2e-2,
              "FlashMmaAttention vs FlashAttention");
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashMmaTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

// ---------------------------------------------------------------------------
// Argument checks: host-only, no CUDA call (fake device pointers are never
// dereferenced because every call here is rejected or has n == 0).
// ---------------------------------------------------------------------------
ck::AttentionArgs ValidLookingArgs() {
  ck::AttentionArgs a;
  a.q = reinterpret_cast<const void*>(uintptr_t{0x10000});
  a.k_cache = reinterpret_cast<const void*>(uintptr_t{0x20000});
  a.v_cache = reinterpret_cast<const void*>(uintptr_t{0x30000});
  a.out = reinterpret_cast<void*>(uintptr_t{0x40000});
  a.dtype = CudaDType::kBF16;
  a.n = 5;
  a.first = 3;
  a.num_heads = 8;
  a.num_kv_heads = 2;
  a.head_dim = 128;
  a.scale = 0.125f;
  return a;
}

TEST(FlashMmaArgsTest, Supported) {
  EXPECT_TRUE(ck::FlashMmaSupported(64, CudaDType::kBF16));
  EXPECT_TRUE(ck::FlashMmaSupported(128, CudaDType::kBF16));
  EXPECT_TRUE(ck::FlashMmaSupported(64, CudaDType::kFP16));
  EXPECT_TRUE(ck::FlashMmaSupported(128, CudaDType::kFP16));
  EXPECT_FALSE(ck::FlashMmaSupported(128, CudaDType::kF32));
  for (int d : {0, 16, 32, 80, 96, 256}) {
    EXPECT_FALSE(ck::FlashMmaSupported(d, CudaDType::kBF16)) << d;
  }
}

TEST(FlashMmaArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  struct Bad {
    const char* what;
    void (*mutate)(ck::AttentionArgs*);
  };
  static int table[4];
  static unsigned long long mask[4];
  const Bad bad[] = {
      {"head_dim 32", [](ck::AttentionArgs* a) { a->head_dim = 32; }},
      {"head_dim 256", [](ck::AttentionArgs* a) { a->head_dim = 256; }},
      {"f32", [](ck::AttentionArgs* a) { a->dtype = CudaDType::kF32; }},
      {"tree_start", [](ck::AttentionArgs* a) { a->tree_start = table; }},
      {"tree_mask", [](ck::AttentionArgs* a) { a->tree_mask = mask; }},
      {"n < 0", [](ck::AttentionArgs* a) { a->n = -1; }},
      {"first < 0", [](ck::AttentionArgs* a) { a->first = -1; }},
      {"no kv heads", [](ck::AttentionArgs* a) { a->num_kv_heads = 0; }},
      {"H % KV", [](ck::AttentionArgs* a) { a->num_heads = 7; }},
      {"H < KV", [](ck::AttentionArgs* a) { a->num_heads = 1; }},
      {"no heads", [](ck::AttentionArgs* a) { a->num_heads = 0; }},
      {"first + n overflows",
       [](ck::AttentionArgs* a) { a->first = INT_MAX - 2; }},
      {"too many rows", [](ck::AttentionArgs* a) { a->n = 64 * 65535 + 1; }},
      {"block_size 0",
       [](ck::AttentionArgs* a) {
         a->block_table = table;
         a->block_size = 0;
       }},
      {"null q", [](ck::AttentionArgs* a) { a->q = nullptr; }},
      {"null k", [](ck::AttentionArgs* a) { a->k_cache = nullptr; }},
      {"null v", [](ck::AttentionArgs* a) { a->v_cache = nullptr; }},
      {"null out", [](ck::AttentionArgs* a) { a->out = nullptr; }},
      {"misaligned q",
       [](ck::AttentionArgs* a) {
         a->q = reinterpret_cast<const void*>(uintptr_t{0x10008});
       }},
      {"misaligned k",
       [](ck::AttentionArgs* a) {
         a->k_cache = reinterpret_cast<const void*>(uintptr_t{0x20002});
       }},
      {"misaligned v",
       [](ck::AttentionArgs* a) {
         a->v_cache = reinterpret_cast<const void*>(uintptr_t{0x30004});
       }},
      {"misaligned out",
       [](ck::AttentionArgs* a) {
         a->out = reinterpret_cast<void*>(uintptr_t{0x40002});
       }},
  };
  for (const Bad& b : bad) {
    ck::AttentionArgs a = ValidLookingArgs();
    b.mutate(&a);
    EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaErrorInvalidValue)
        << b.what;
  }
}

TEST(FlashMmaArgsTest, ZeroRowsIsANoOp) {
  ck::AttentionArgs a = ValidLookingArgs();
  a.n = 0;
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaSuccess);
  a.q = nullptr;
  a.out = nullptr;
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaSuccess);
  a.tree_start = reinterpret_cast<const int*>(uintptr_t{0x50000});
  EXPECT_EQ(ck::FlashMmaAttention(a, nullptr), cudaErrorInvalidValue);
}

// ---------------------------------------------------------------------------
// Timing (prints only): causal prefill, H = 32, KV = 8, D = 128, bf16,
// block size 16 through a shuffled table.
// ---------------------------------------------------------------------------
TEST(FlashMmaTimingTest, ReportsTflops) {
  if (!CudaAvailable()) {
    GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
  }
  std::printf("device: %s\n", CudaDeviceDescription().c_str());
  constexpr int kH = 32, kKV = 8, kD = 128, kBs = 16;
  for (int n : {4096, 16384}) {
    std::mt19937 rng(n);
    auto fill = [&rng](std::vector<uint16_t>* v) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (auto& x : *v) x = ToBf16(u(rng));
    };
    const int blocks = (n + kBs - 1) / kBs;
    std::vector<uint16_t> q(static_cast<size_t>(n) * kH * kD);
    std::vector<uint16_t> kv(static_cast<size_t>(blocks) * kBs * kKV * kD);
    fill(&q);
    fill(&kv);
    std::vector<int> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    DeviceArray d_q(q.size() * 2), d_k(kv.size() * 2), d_v(kv.size() * 2),
        d_out(q.size() * 2), d_table(table.size() * sizeof(int));
    ASSERT_CUDA_OK(d_q.Upload(q));
    ASSERT_CUDA_OK(d_k.Upload(kv));
    ASSERT_CUDA_OK(d_v.Upload(kv));
    ASSERT_CUDA_OK(d_table.Upload(table));
    ck::AttentionArgs a;
    a.q = d_q.get();
    a.k_cache = d_k.get();
    a.v_cache = d_v.get();
    a.out = d_out.get();
    a.dtype = CudaDType::kBF16;
    a.n = n;
    a.num_heads = kH;
    a.num_kv_heads = kKV;
    a.head_dim = kD;
    a.scale = 1.0f / std::sqrt(float(kD));
    a.block_table = static_cast<const int*>(d_table.get());
    a.block_size = kBs;
    // Causal: every row i sees i + 1 keys; 2 flops per multiply-add in
    // Q K^T and in P V.
    const double flops = 4.0 * kD * kH * (double(n) * (n + 1) / 2);
    cudaEvent_t start, stop;
    ASSERT_CUDA_OK(cudaEventCreate(&start));
    ASSERT_CUDA_OK(cudaEventCreate(&stop));
    for (const auto& [name, kernel] :
         {std::pair<const char*, Kernel>{"FlashMmaAttention",
                                         &ck::FlashMmaAttention},
          std::pair<const char*, Kernel>{"FlashAttention (WMMA)",
                                         &ck::FlashAttention}}) {
      ASSERT_CUDA_OK(kernel(a, nullptr));  // warm-up
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      constexpr int kReps = 5;
      ASSERT_CUDA_OK(cudaEventRecord(start, nullptr));
      for (int r = 0; r < kReps; ++r) ASSERT_CUDA_OK(kernel(a, nullptr));
      ASSERT_CUDA_OK(cudaEventRecord(stop, nullptr));
      ASSERT_CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
      ms /= kReps;
      std::printf(
          "%-22s n=%-6d H=%d KV=%d D=%d causal: %8.3f ms  %6.1f "
          "TFLOP/s\n",
          name, n, kH, kKV, kD, ms, flops / (ms * 1e-3) / 1e12);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
}

}  // namespace
}  // namespace specserve
