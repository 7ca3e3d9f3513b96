#include "common/specprefill/importance.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECSERVE_SPECPREFILL_AVX2 1
#endif

namespace specserve {
namespace {

// ---------------------------------------------------------------------------
// exp(x) for x <= 0 (softmax after max subtraction). Cephes-style range
// reduction x = n ln2 + r and a degree-5 polynomial for e^r: ~2 ulp, and
// exactly 0 below -87.3 (where fp32 underflows), like expf. The scalar and
// AVX2 versions perform the same operations so tails match the body.
// ---------------------------------------------------------------------------
constexpr float kExpLo = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;

inline float ExpNonPositive(float x) {
  if (x < kExpLo) return 0.0f;
  const float fx = std::floor(std::fma(x, kLog2e, 0.5f));
  float r = std::fma(fx, -kLn2Hi, x);
  r = std::fma(fx, -kLn2Lo, r);
  float y = kP0;
  y = std::fma(y, r, kP1);
  y = std::fma(y, r, kP2);
  y = std::fma(y, r, kP3);
  y = std::fma(y, r, kP4);
  y = std::fma(y, r, kP5);
  y = std::fma(y, r * r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#ifdef SPECSERVE_SPECPREFILL_AVX2
inline __m256 ExpNonPositive8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLo));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r),
                      _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, y);
}
#endif

// Max of x[0..n), n >= 1.
float RowMax(const float* x, int n) {
  int j = 0;
  float m = -std::numeric_limits<float>::infinity();
#ifdef SPECSERVE_SPECPREFILL_AVX2
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8)
      vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (float v : lanes) m = std::max(m, v);
  }
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// x[j] = exp(x[j] - mx) in place; returns the sum (accumulated in double so
// that 32K-token rows do not lose the small probabilities' mass).
double ExpInPlace(float* x, int n, float mx) {
  int j = 0;
  double sum = 0.0;
#ifdef SPECSERVE_SPECPREFILL_AVX2
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256d acc_lo = _mm256_setzero_pd();
  __m256d acc_hi = _mm256_setzero_pd();
  for (; j + 8 <= n; j += 8) {
    const __m256 e =
        ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmx));
    _mm256_storeu_ps(x + j, e);
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc_hi =
        _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc_lo, acc_hi));
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; j < n; ++j) {
    x[j] = ExpNonPositive(x[j] - mx);
    sum += x[j];
  }
  return sum;
}

// dst[j] = a[j] + b[j], j < n.
void AddRows(const float* a, const float* b, float* dst, int n) {
  int j = 0;
#ifdef SPECSERVE_SPECPREFILL_AVX2
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(
        dst + j, _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j)));
  }
#endif
  for (; j < n; ++j) dst[j] = a[j] + b[j];
}

enum class Fold { kAssign, kMax, kAdd };

// dst[j] (=, max=, +=) src[j] * scale, j < n.
void FoldScaled(const float* src, float scale, Fold fold, float* dst, int n) {
  int j = 0;
#ifdef SPECSERVE_SPECPREFILL_AVX2
  const __m256 vs = _mm256_set1_ps(scale);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + j), vs);
    __m256 out = v;
    if (fold == Fold::kMax) {
      out = _mm256_max_ps(_mm256_loadu_ps(dst + j), v);
    } else if (fold == Fold::kAdd) {
      out = _mm256_add_ps(_mm256_loadu_ps(dst + j), v);
    }
    _mm256_storeu_ps(dst + j, out);
  }
#endif
  for (; j < n; ++j) {
    const float v = src[j] * scale;
    if (fold == Fold::kAssign) {
      dst[j] = v;
    } else if (fold == Fold::kMax) {
      dst[j] = std::max(dst[j], v);
    } else {
      dst[j] += v;
    }
  }
}

// Floats of scratch PoolWindowSums needs for a row of n and kernel k.
size_t PoolScratchFloats(int n, int k) {
  return 2 * static_cast<size_t>(n + k - 1);
}

// out[j] = sum_{t=-k/2}^{k/2} x[j+t] (zero outside [0, n)), j < n; k odd.
//
// Why not a running sum (add the entering value, subtract the leaving one):
// in fp32 its rounding error accumulates along the whole row (~n ulps of the
// largest window), which swamps the small probabilities that decide which
// chunks are dropped, and in fp64 its serial dependency chain makes it the
// slowest part of scoring. Instead windows are built by doubling: pass p
// holds sums of 2^p consecutive values, and the set bits of k pick which of
// them make up a window. That is floor(log2 k) + popcount(k) vectorised
// O(n) passes (5 for k = 13), and every output is a short tree of adds of
// the window's own values, so there is no drift.
void PoolWindowSums(const float* x, int n, int k, float* out, float* scratch) {
  const int h = k / 2;
  const int len = n + k - 1;  // zero padded: [h zeros, x, h zeros]
  float* cur = scratch;
  float* next = scratch + len;
  std::fill(cur, cur + h, 0.0f);
  std::memcpy(cur + h, x, sizeof(float) * n);
  std::fill(cur + h + n, cur + len, 0.0f);
  int width = 1;    // cur[j] = sum of `width` padded values from j
  int valid = len;  // cur[j] is defined for j < valid
  int offset = 0;   // padded index where the next window segment starts
  bool first = true;
  for (int bit = 1; bit <= k; bit <<= 1) {
    if (k & bit) {
      if (first) {
        std::memcpy(out, cur + offset, sizeof(float) * n);
        first = false;
      } else {
        AddRows(out, cur + offset, out, n);
      }
      offset += width;
    }
    if ((bit << 1) <= k) {
      AddRows(cur, cur + width, next, valid - width);
      valid -= width;
      width <<= 1;
      std::swap(cur, next);
    }
  }
}

// ---------------------------------------------------------------------------
// Q.K^T in blocks of 16 prompt keys. A block of one kv head's keys is packed
// into kt[head_dim][16] (key-major -> dim-major), then every query vector of
// that kv head multiplies it: out[m][j] = q[m] . key_j. Each logit is one
// fma chain over d in order, whatever the blocking, so results do not depend
// on how work is split across threads.
// ---------------------------------------------------------------------------
constexpr int kKeyBlock = 16;

#ifdef SPECSERVE_SPECPREFILL_AVX2
// In-register transpose of the 8x8 block r[i][c] -> r[c][i].
inline void Transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]);
  const __m256 t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]);
  const __m256 t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]);
  const __m256 t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]);
  const __m256 t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

// kt[d][i] = keys[i * stride + d] for i < nb, 0 for nb <= i < 16.
void PackKeyBlock(const float* keys, size_t stride, int nb, int head_dim,
                  float* kt) {
#ifdef SPECSERVE_SPECPREFILL_AVX2
  if (head_dim % 8 == 0) {
    for (int half = 0; half < 2; ++half) {
      for (int d0 = 0; d0 < head_dim; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const int j = half * 8 + i;
          r[i] = j < nb ? _mm256_loadu_ps(keys + j * stride + d0)
                        : _mm256_setzero_ps();
        }
        Transpose8x8(r);
        for (int c = 0; c < 8; ++c) {
          _mm256_storeu_ps(kt + (d0 + c) * kKeyBlock + half * 8, r[c]);
        }
      }
    }
    return;
  }
#endif
  for (int d = 0; d < head_dim; ++d) {
    for (int i = 0; i < kKeyBlock; ++i) {
      kt[d * kKeyBlock + i] = i < nb ? keys[i * stride + d] : 0.0f;
    }
  }
}

// out[m * ld + i] = q[m] . kt[:, i] for m < num_q, i < nb; q is
// [num_q, head_dim] contiguous. AVX2: 4 query rows at a time accumulate
// 4 x 16 logits in 8 registers (per d: 2 key loads + 4 broadcasts, 8 FMAs).
void MulKeyBlock(const float* q, int num_q, int head_dim, const float* kt,
                 int nb, float* out, size_t ld) {
#ifdef SPECSERVE_SPECPREFILL_AVX2
  alignas(32) float tmp[kKeyBlock];
  auto store = [&](float* dst, __m256 lo, __m256 hi) {
    if (nb == kKeyBlock) {
      _mm256_storeu_ps(dst, lo);
      _mm256_storeu_ps(dst + 8, hi);
    } else {
      _mm256_store_ps(tmp, lo);
      _mm256_store_ps(tmp + 8, hi);
      std::memcpy(dst, tmp, sizeof(float) * nb);
    }
  };
  int m = 0;
  for (; m + 4 <= num_q; m += 4) {
    const float* q0 = q + static_cast<size_t>(m) * head_dim;
    const float* q1 = q0 + head_dim;
    const float* q2 = q1 + head_dim;
    const float* q3 = q2 + head_dim;
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
    __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
    __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; ++d) {
      const __m256 k0 = _mm256_load_ps(kt + d * kKeyBlock);
      const __m256 k1 = _mm256_load_ps(kt + d * kKeyBlock + 8);
      __m256 b = _mm256_broadcast_ss(q0 + d);
      a00 = _mm256_fmadd_ps(b, k0, a00);
      a01 = _mm256_fmadd_ps(b, k1, a01);
      b = _mm256_broadcast_ss(q1 + d);
      a10 = _mm256_fmadd_ps(b, k0, a10);
      a11 = _mm256_fmadd_ps(b, k1, a11);
      b = _mm256_broadcast_ss(q2 + d);
      a20 = _mm256_fmadd_ps(b, k0, a20);
      a21 = _mm256_fmadd_ps(b, k1, a21);
      b = _mm256_broadcast_ss(q3 + d);
      a30 = _mm256_fmadd_ps(b, k0, a30);
      a31 = _mm256_fmadd_ps(b, k1, a31);
    }
    store(out + (m + 0) * ld, a00, a01);
    store(out + (m + 1) * ld, a10, a11);
    store(out + (m + 2) * ld, a20, a21);
    store(out + (m + 3) * ld, a30, a31);
  }
  for (; m < num_q; ++m) {
    const float* qm = q + static_cast<size_t>(m) * head_dim;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; ++d) {
      const __m256 b = _mm256_broadcast_ss(qm + d);
      a0 = _mm256_fmadd_ps(b, _mm256_load_ps(kt + d * kKeyBlock), a0);
      a1 = _mm256_fmadd_ps(b, _mm256_load_ps(kt + d * kKeyBlock + 8), a1);
    }
    store(out + m * ld, a0, a1);
  }
#else
  for (int m = 0; m < num_q; ++m) {
    const float* qm = q + static_cast<size_t>(m) * head_dim;
    for (int i = 0; i < nb; ++i) {
      float acc = 0.0f;
      for (int d = 0; d < head_dim; ++d) {
        acc = std::fma(qm[d], kt[d * kKeyBlock + i], acc);
      }
      out[m * ld + i] = acc;
    }
  }
#endif
}

// Runs fn(item, worker) for item in [0, items) on `workers` threads (the
// caller's thread is worker 0), items handed out dynamically.
template <typename Fn>
void ParallelFor(int workers, int items, const Fn& fn) {
  workers = std::max(1, std::min(workers, items));
  if (workers == 1) {
    for (int item = 0; item < items; ++item) fn(item, 0);
    return;
  }
  std::atomic<int> next{0};
  auto loop = [&](int w) {
    for (int item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      fn(item, w);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) threads.emplace_back(loop, w);
  loop(0);
  for (std::thread& t : threads) t.join();
}

}  // namespace

absl::Status ValidateScoringOptions(const ScoringOptions& opts,
                                    int num_layers) {
  if (opts.pool_kernel_size < 1 || opts.pool_kernel_size % 2 == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScoringOptions.pool_kernel_size must be odd and >= 1, "
                     "got ",
                     opts.pool_kernel_size));
  }
  if (opts.num_layers_used < 0 || opts.num_layers_used > num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScoringOptions.num_layers_used must be in [0, num_layers=", num_layers,
        "], got ", opts.num_layers_used));
  }
  if (opts.head_layer_aggregation != ScoringOptions::Aggregation::kMax &&
      opts.head_layer_aggregation != ScoringOptions::Aggregation::kMean) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScoringOptions.head_layer_aggregation is not kMax or kMean: ",
        static_cast<int>(opts.head_layer_aggregation)));
  }
  return absl::OkStatus();
}

std::vector<float> AvgPool1d(absl::Span<const float> x, int kernel) {
  assert(kernel >= 1 && kernel % 2 == 1);
  const int n = static_cast<int>(x.size());
  std::vector<float> out(x.size());
  if (n == 0) return out;
  std::vector<float> scratch(PoolScratchFloats(n, kernel));
  PoolWindowSums(x.data(), n, kernel, out.data(), scratch.data());
  const float inv = 1.0f / static_cast<float>(kernel);
  for (float& v : out) v *= inv;
  return out;
}

namespace {

absl::Status ValidateShape(int prompt_len, int num_rows, int num_heads,
                           int num_kv_heads, int head_dim, int num_layers) {
  const std::pair<const char*, int> positive[] = {
      {"prompt_len", prompt_len}, {"num_rows", num_rows},
      {"num_heads", num_heads},   {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim},     {"num_layers", num_layers}};
  for (const auto& [name, value] : positive) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ImportanceAccumulator: ", name, " must be >= 1, got ", value));
    }
  }
  if (num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImportanceAccumulator: num_heads (", num_heads,
        ") must be a multiple of num_kv_heads (", num_kv_heads, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

ImportanceAccumulator::ImportanceAccumulator(int prompt_len, int num_rows,
                                             int num_heads, int num_kv_heads,
                                             int head_dim, int num_layers,
                                             const ScoringOptions& opts)
    : prompt_len_(prompt_len),
      num_rows_(num_rows),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      num_layers_(num_layers),
      opts_(opts) {
  status_ = ValidateShape(prompt_len, num_rows, num_heads, num_kv_heads,
                          head_dim, num_layers);
  if (status_.ok()) status_ = ValidateScoringOptions(opts, num_layers);
  if (!status_.ok()) return;
  added_.assign(num_layers, false);
  // Probabilities are >= 0, so 0 is the identity for both max and sum.
  running_.assign(static_cast<size_t>(num_rows) * prompt_len, 0.0f);
}

absl::StatusOr<ImportanceAccumulator> ImportanceAccumulator::Create(
    int prompt_len, int num_rows, int num_heads, int num_kv_heads, int head_dim,
    int num_layers, const ScoringOptions& opts) {
  ImportanceAccumulator acc(prompt_len, num_rows, num_heads, num_kv_heads,
                            head_dim, num_layers, opts);
  if (!acc.status().ok()) return acc.status();
  return acc;
}

void ImportanceAccumulator::set_num_threads(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  num_threads_ = std::max(1, num_threads);
}

bool ImportanceAccumulator::UsesLayer(int layer) const {
  if (layer < 0 || layer >= num_layers_) return false;
  return opts_.num_layers_used == 0 ||
         layer >= num_layers_ - opts_.num_layers_used;
}

bool ImportanceAccumulator::complete() const {
  if (!status_.ok()) return false;
  const int used =
      opts_.num_layers_used == 0 ? num_layers_ : opts_.num_layers_used;
  return layers_added_ == used;
}

void ImportanceAccumulator::ComputeLogits(int block_begin, int block_end,
                                          const float* keys,
                                          size_t key_row_stride, float* kt) {
  const int group = num_heads_ / num_kv_heads_;
  const int num_q = num_rows_ * group;  // query vectors per kv head
  const size_t n = static_cast<size_t>(prompt_len_);
  const size_t kt_per_head = static_cast<size_t>(kKeyBlock) * head_dim_;
  const int row_floats = num_kv_heads_ * head_dim_;
  for (int b = block_begin; b < block_end; ++b) {
    const int j0 = b * kKeyBlock;
    const int nb = std::min(kKeyBlock, prompt_len_ - j0);
    const float* block = keys + static_cast<size_t>(j0) * key_row_stride;
    // Pack every kv head of these 16 tokens first: the keys come from DRAM
    // (a layer's keys outgrow L2 at long prompts), and reading whole token
    // rows in order is a stream the hardware prefetcher follows, unlike one
    // kv head's slice at a time (strided, and at power-of-two strides the
    // slices of consecutive tokens alias to a few L1 sets).
    for (int g = 0; g < num_kv_heads_; ++g) {
      PackKeyBlock(block + static_cast<size_t>(g) * head_dim_, key_row_stride,
                   nb, head_dim_, kt + g * kt_per_head);
    }
    // Ask for the next block while this one computes (~10x longer).
    if (b + 1 < block_end) {
      const int nb_next = std::min(kKeyBlock, prompt_len_ - j0 - nb);
      const float* next = block + static_cast<size_t>(nb) * key_row_stride;
      for (int i = 0; i < nb_next; ++i) {
        const float* row = next + i * key_row_stride;
        for (int off = 0; off < row_floats; off += 16) {
          __builtin_prefetch(row + off, 0, 2);
        }
        __builtin_prefetch(row + row_floats - 1, 0, 2);
      }
    }
    for (int g = 0; g < num_kv_heads_; ++g) {
      MulKeyBlock(q_.data() + static_cast<size_t>(g) * num_q * head_dim_, num_q,
                  head_dim_, kt + g * kt_per_head, nb,
                  logits_.data() + static_cast<size_t>(g) * num_q * n + j0, n);
    }
  }
}

void ImportanceAccumulator::ReduceKvHead(int g, int row_begin, int row_end,
                                         float* scratch) {
  const int group = num_heads_ / num_kv_heads_;
  const int n = prompt_len_;
  const int k = opts_.pool_kernel_size;
  float* pooled = scratch;
  float* pool_scratch = scratch + n;
  const bool is_max =
      opts_.head_layer_aggregation == ScoringOptions::Aggregation::kMax;
  for (int r = row_begin; r < row_end; ++r) {
    float* dst = partial_.data() + (static_cast<size_t>(g) * num_rows_ + r) * n;
    for (int i = 0; i < group; ++i) {
      // Logit rows of kv head g are ordered (row, head within group).
      float* row = logits_.data() +
                   ((static_cast<size_t>(g) * num_rows_ + r) * group + i) * n;
      const float mx = RowMax(row, n);
      const double sum = ExpInPlace(row, n, mx);
      // softmax = e / sum, then avg_pool divides by k: one scale for both.
      const float inv = static_cast<float>(1.0 / (sum * k));
      const float* src = row;
      if (k > 1) {
        PoolWindowSums(row, n, k, pooled, pool_scratch);
        src = pooled;
      }
      const Fold fold =
          i == 0 ? Fold::kAssign : (is_max ? Fold::kMax : Fold::kAdd);
      FoldScaled(src, inv, fold, dst, n);
    }
  }
}

absl::Status CheckAddLayerArgs(int layer, int num_layers, const void* queries,
                               const void* keys, size_t key_row_stride,
                               int num_kv_heads, int head_dim) {
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AddLayer: layer ", layer, " is outside [0, ", num_layers, ")"));
  }
  if (queries == nullptr || keys == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("AddLayer: layer ", layer, ": ",
                     queries == nullptr ? "queries" : "keys", " is null"));
  }
  if (key_row_stride < static_cast<size_t>(num_kv_heads) * head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("AddLayer: key_row_stride ", key_row_stride,
                     " is smaller than num_kv_heads * head_dim = ",
                     num_kv_heads * head_dim));
  }
  return absl::OkStatus();
}

absl::Status ImportanceAccumulator::AddLayer(int layer, const float* queries,
                                             const float* keys,
                                             size_t key_row_stride) {
  if (!status_.ok()) return status_;
  if (absl::Status s =
          CheckAddLayerArgs(layer, num_layers_, queries, keys, key_row_stride,
                            num_kv_heads_, head_dim_);
      !s.ok()) {
    return s;
  }
  if (!UsesLayer(layer)) return absl::OkStatus();
  if (added_[layer]) {
    return absl::FailedPreconditionError(
        absl::StrCat("AddLayer: layer ", layer, " was already added"));
  }

  const int group = num_heads_ / num_kv_heads_;
  const size_t n = static_cast<size_t>(prompt_len_);
  const size_t plane = static_cast<size_t>(num_rows_) * n;
  const int d = head_dim_;
  // Queries regrouped by kv head, [kv_heads][rows][group][head_dim] (a row's
  // heads of one group are adjacent already), with 1/sqrt(head_dim) folded
  // in.
  q_.resize(static_cast<size_t>(num_rows_) * num_heads_ * d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int g = 0; g < num_kv_heads_; ++g) {
    for (int r = 0; r < num_rows_; ++r) {
      const float* src = queries + (static_cast<size_t>(r) * num_heads_ +
                                    static_cast<size_t>(g) * group) *
                                       d;
      float* dst =
          q_.data() + (static_cast<size_t>(g) * num_rows_ + r) * group * d;
      for (int i = 0; i < group * d; ++i) dst[i] = src[i] * scale;
    }
  }
  logits_.resize(static_cast<size_t>(num_heads_) * plane);
  partial_.resize(static_cast<size_t>(num_kv_heads_) * plane);

  // Phase 1: logits for all heads, parallel over ranges of key blocks. All
  // kv heads of a block are done together so the prompt's keys stream
  // through memory once, in order (one kv head at a time would stride over
  // the whole cache once per kv head and stall on cache and TLB misses).
  const int key_blocks = (prompt_len_ + kKeyBlock - 1) / kKeyBlock;
  const int workers1 = std::max(1, std::min(num_threads_, key_blocks));
  const size_t kt_floats = static_cast<size_t>(num_kv_heads_) * kKeyBlock * d;
  if (static_cast<int>(scratch_.size()) < num_threads_) {
    scratch_.resize(num_threads_);
  }
  ParallelFor(workers1, workers1, [&](int item, int w) {
    std::vector<float>& scratch = scratch_[w];
    // +8 floats so kt can be 32-byte aligned.
    if (scratch.size() < kt_floats + 8) {
      scratch.resize(kt_floats + 8);
    }
    float* kt = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 31) &
        ~static_cast<uintptr_t>(31));
    const int begin =
        static_cast<int>(static_cast<int64_t>(key_blocks) * item / workers1);
    const int end = static_cast<int>(static_cast<int64_t>(key_blocks) *
                                     (item + 1) / workers1);
    ComputeLogits(begin, end, keys, key_row_stride, kt);
  });

  // Phase 2: softmax, pooling and the max/sum over each kv head's query
  // heads, per (kv head, row block). Rows are split only when there are
  // more threads than kv heads.
  const int row_blocks =
      std::min(num_rows_, (num_threads_ + num_kv_heads_ - 1) / num_kv_heads_);
  const int items = num_kv_heads_ * row_blocks;
  const size_t reduce_floats =
      n + PoolScratchFloats(prompt_len_, opts_.pool_kernel_size);
  ParallelFor(num_threads_, items, [&](int item, int w) {
    std::vector<float>& scratch = scratch_[w];
    if (scratch.size() < reduce_floats) scratch.resize(reduce_floats);
    const int g = item / row_blocks;
    const int b = item % row_blocks;
    const int row_begin =
        static_cast<int>(static_cast<int64_t>(num_rows_) * b / row_blocks);
    const int row_end = static_cast<int>(static_cast<int64_t>(num_rows_) *
                                         (b + 1) / row_blocks);
    ReduceKvHead(g, row_begin, row_end, scratch.data());
  });

  // Fold kv heads in a fixed order: thread-count independent results.
  const Fold fold =
      opts_.head_layer_aggregation == ScoringOptions::Aggregation::kMax
          ? Fold::kMax
          : Fold::kAdd;
  for (int g = 0; g < num_kv_heads_; ++g) {
    FoldScaled(partial_.data() + g * plane, 1.0f, fold, running_.data(),
               static_cast<int>(plane));
  }
  added_[layer] = true;
  ++layers_added_;
  return absl::OkStatus();
}

std::vector<std::vector<float>> ImportanceAccumulator::PerRowImportance()
    const {
  if (!status_.ok()) return {};
  std::vector<std::vector<float>> out(num_rows_,
                                      std::vector<float>(prompt_len_, 0.0f));
  if (layers_added_ == 0) return out;
  float scale = 1.0f;
  if (opts_.head_layer_aggregation == ScoringOptions::Aggregation::kMean) {
    scale = static_cast<float>(
        1.0 / (static_cast<double>(layers_added_) * num_heads_));
  }
  for (int r = 0; r < num_rows_; ++r) {
    const float* src = running_.data() + static_cast<size_t>(r) * prompt_len_;
    for (int j = 0; j < prompt_len_; ++j) out[r][j] = src[j] * scale;
  }
  return out;
}

std::vector<float> ImportanceAccumulator::Importance() const {
  if (!status_.ok()) return {};
  const std::vector<std::vector<float>> per_row = PerRowImportance();
  std::vector<float> out(prompt_len_, 0.0f);
  for (int j = 0; j < prompt_len_; ++j) {
    double sum = 0.0;
    for (int r = 0; r < num_rows_; ++r) sum += per_row[r][j];
    out[j] = static_cast<float>(sum / num_rows_);
  }
  return out;
}

}  // namespace specserve
