#ifndef SPECSERVE_COMMON_CUDA_PREFILL_ATTENTION_TEST_UTIL_H_
#define SPECSERVE_COMMON_CUDA_PREFILL_ATTENTION_TEST_UTIL_H_

// Test problems for the prefill attention kernels (flash_mma_test,
// cudnn_attention_test): random q / k / v rounded to bf16 / fp16 on the host
// exactly as the device stores them, K and V scattered into a paged pool
// through a shuffled block table whose unused rows hold NaN (a read of a
// wrong row shows), a float64 host reference of causal grouped-query
// attention, and a runner for any launcher with FlashAttention's signature.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_format.h"
#include "common/cuda/device_array_test_util.h"
#include "common/cuda/kernels.h"
#include "gtest/gtest.h"

namespace specserve {
namespace attention_test {

// ---------------------------------------------------------------------------
// Host 16-bit formats (round to nearest even), the device's storage.
// ---------------------------------------------------------------------------
inline uint16_t ToBf16(float f) {
  const uint32_t u = absl::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Finite inputs well inside the fp16 range (|f| < 65504).
inline uint16_t ToFp16(float f) {
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

inline float FromBf16(uint16_t b) {
  return absl::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline float FromFp16(uint16_t b) {
  const uint32_t sign = (b & 0x8000u) << 16;
  const uint32_t e = (b >> 10) & 0x1Fu, m = b & 0x3FFu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return absl::bit_cast<float>(sign | 0x7F800000u | (m << 13));
  return absl::bit_cast<float>(sign | ((e - 15 + 127) << 23) | (m << 13));
}

inline uint16_t ToBits(float f, CudaDType dtype) {
  return dtype == CudaDType::kBF16 ? ToBf16(f) : ToFp16(f);
}
inline float FromBits(uint16_t b, CudaDType dtype) {
  return dtype == CudaDType::kBF16 ? FromBf16(b) : FromFp16(b);
}


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

inline std::string CaseName(const Case& c) {
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

inline Problem MakeProblem(const Case& c, uint32_t seed) {
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

inline float Scale(const Case& c) { return 1.0f / std::sqrt(float(c.head_dim)); }

// float64 causal GQA attention: out [n, H * D].
inline std::vector<double> Reference(const Problem& p) {
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

/// A prefill attention launcher with FlashAttention's signature.
using Kernel = cudaError_t (*)(const cuda_kernels::AttentionArgs&,
                               cudaStream_t);

// Runs `kernel` on the problem; *out gets the decoded output. The output is
// poisoned first (NaN bits), so a row the kernel skips fails.
inline void RunKernel(const Problem& p, Kernel kernel, std::vector<float>* out) {
  const Case& c = p.c;
  testing_cuda::DeviceArray d_q(p.q.size() * 2), d_k(p.pool_k.size() * 2),
      d_v(p.pool_v.size() * 2), d_out(p.q.size() * 2),
      d_table(p.block_table.size() * sizeof(int));
  ASSERT_CUDA_OK(d_q.Upload(p.q));
  ASSERT_CUDA_OK(d_k.Upload(p.pool_k));
  ASSERT_CUDA_OK(d_v.Upload(p.pool_v));
  ASSERT_CUDA_OK(d_table.Upload(p.block_table));
  std::vector<uint16_t> out_bits(p.q.size(), 0xFFFF);
  ASSERT_CUDA_OK(d_out.Upload(out_bits));
  cuda_kernels::AttentionArgs a;
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
inline void ExpectClose(const Case& c, const std::vector<float>& got,
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

/// The shapes every prefill kernel is checked on: bf16 and fp16, head_dim
/// 64 and 128, full prefills and chunks after cached keys, GQA groups of
/// 4, 2 and 1, lengths that are not tile multiples, block sizes 16 and 1
/// and a contiguous cache, one peaky softmax.
inline std::vector<Case> Cases() {
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

/// The timing reports' problem: causal prefill of `n` rows, H = 32, KV = 8,
/// D = 128, bf16, K / V in a paged pool of block size 16 through a shuffled
/// table, on the device; `args` is ready for a FlashAttention-style launch.
struct TimingProblem {
  static constexpr int kH = 32, kKV = 8, kD = 128, kBs = 16;
  explicit TimingProblem(int n)
      : n(n),
        q(static_cast<size_t>(n) * kH * kD * 2),
        k(PoolRows(n) * kKV * kD * 2),
        v(PoolRows(n) * kKV * kD * 2),
        out(static_cast<size_t>(n) * kH * kD * 2),
        table(PoolRows(n) / kBs * sizeof(int)) {
    std::mt19937 rng(n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto upload = [&](testing_cuda::DeviceArray& d, size_t elements) {
      std::vector<uint16_t> bits(elements);
      for (uint16_t& x : bits) x = ToBf16(u(rng));
      EXPECT_EQ(d.Upload(bits), cudaSuccess);
    };
    upload(q, static_cast<size_t>(n) * kH * kD);
    upload(k, PoolRows(n) * kKV * kD);
    upload(v, PoolRows(n) * kKV * kD);
    std::vector<int> ids(PoolRows(n) / kBs);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    EXPECT_EQ(table.Upload(ids), cudaSuccess);
    args.q = q.get();
    args.k_cache = k.get();
    args.v_cache = v.get();
    args.out = out.get();
    args.dtype = CudaDType::kBF16;
    args.n = n;
    args.num_heads = kH;
    args.num_kv_heads = kKV;
    args.head_dim = kD;
    args.scale = 1.0f / std::sqrt(float(kD));
    args.block_table = static_cast<const int*>(table.get());
    args.block_size = kBs;
  }
  static size_t PoolRows(int n) {
    return static_cast<size_t>((n + kBs - 1) / kBs) * kBs;
  }
  /// Causal: row i sees i + 1 keys; 2 flops per multiply-add in Q K^T and
  /// in P V.
  double Flops() const { return 4.0 * kD * kH * (double(n) * (n + 1) / 2); }

  int n;
  testing_cuda::DeviceArray q, k, v, out, table;
  cuda_kernels::AttentionArgs args;
};

/// Milliseconds per call of `launch` on the legacy stream (one untimed
/// warm-up call, then `reps`), and prints one report line. -1 on a CUDA
/// error (reported as a test failure).
template <typename Launch>
double TimeAndReport(const char* name, const TimingProblem& p, Launch launch,
                     int reps = 5) {
  cudaEvent_t start, stop;
  if (launch() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
      cudaEventCreate(&start) != cudaSuccess ||
      cudaEventCreate(&stop) != cudaSuccess) {
    ADD_FAILURE() << name << ": CUDA error";
    return -1;
  }
  cudaEventRecord(start, nullptr);
  bool ok = true;
  for (int r = 0; r < reps; ++r) ok &= launch() == cudaSuccess;
  cudaEventRecord(stop, nullptr);
  float ms = 0.0f;
  ok &= cudaEventSynchronize(stop) == cudaSuccess &&
        cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!ok) {
    ADD_FAILURE() << name << ": CUDA error";
    return -1;
  }
  ms /= reps;
  std::printf("%-22s n=%-6d H=%d KV=%d D=%d causal: %8.3f ms  %6.1f "
              "TFLOP/s\n",
              name, p.n, TimingProblem::kH, TimingProblem::kKV,
              TimingProblem::kD, ms, p.Flops() / (ms * 1e-3) / 1e12);
  return ms;
}

}  // namespace attention_test
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_PREFILL_ATTENTION_TEST_UTIL_H_
