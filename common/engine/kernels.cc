#include "common/engine/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace specserve {
namespace kernels {
namespace {

// exp(x) for 8 lanes: range reduction x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial for e^r (Cephes expf coefficients), scaled by 2^n.
inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
  // exp(x) underflows below lo: 0 there (and for -inf, a masked score),
  // where the exponent bits built below would wrap to -inf.
  const __m256 above_lo = _mm256_cmp_ps(x, lo, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 c1 = _mm256_set1_ps(0.693359375f);
  const __m256 c2 = _mm256_set1_ps(-2.12194440e-4f);
  __m256 r = _mm256_fnmadd_ps(n, c1, x);
  r = _mm256_fnmadd_ps(n, c2, r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_cvtps_epi32(n);
  e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), above_lo);
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HorizontalMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

void RmsNorm(const float* x, size_t x_stride, const float* w, float eps,
             int rows, int dim, float* out, size_t out_stride) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= dim; i += 8) {
      __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    double ss = HorizontalSum(acc);
    for (; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    const __m256 s = _mm256_set1_ps(scale);
    i = 0;
    for (; i + 8 <= dim; i += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), s);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
    }
    for (; i < dim; ++i) o[i] = xr[i] * scale * w[i];
  }
}

void ApplyRope(float* x, size_t row_stride, int rows, int num_heads,
               int head_dim, const int* positions, double theta) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(theta, -2.0 * i / head_dim);
  }
  ApplyRope(x, row_stride, rows, num_heads, head_dim, positions,
            inv_freq.data(), 1.0);
}

void ApplyRope(float* x, size_t row_stride, int rows, int num_heads,
               int head_dim, const int* positions, const double* inv_freq,
               double attention_factor) {
  const int half = head_dim / 2;
  std::vector<float> cs(half), sn(half);
  for (int r = 0; r < rows; ++r) {
    const double pos = positions[r];
    for (int i = 0; i < half; ++i) {
      const double a = pos * inv_freq[i];
      cs[i] = static_cast<float>(std::cos(a) * attention_factor);
      sn[i] = static_cast<float>(std::sin(a) * attention_factor);
    }
    float* row = x + r * row_stride;
    for (int h = 0; h < num_heads; ++h) {
      float* v = row + h * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i];
        const float x2 = v[i + half];
        v[i] = x1 * cs[i] - x2 * sn[i];
        v[i + half] = x2 * cs[i] + x1 * sn[i];
      }
    }
  }
}

void AddBias(float* x, size_t stride, int rows, int cols, const float* bias) {
  for (int r = 0; r < rows; ++r) {
    float* row = x + r * stride;
    for (int i = 0; i < cols; ++i) row[i] += bias[i];
  }
}

void SiluMul(const float* gu, int rows, int ffn, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* g = gu + static_cast<size_t>(r) * 2 * ffn;
    const float* u = g + ffn;
    float* o = out + static_cast<size_t>(r) * ffn;
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 zero = _mm256_setzero_ps();
    for (; i + 8 <= ffn; i += 8) {
      __m256 gv = _mm256_loadu_ps(g + i);
      __m256 e = Exp8(_mm256_sub_ps(zero, gv));
      __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < ffn; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

namespace {

float MaxOfAvx2(const float* x, int n) {
  int i = 0;
  float m = x[0];
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    m = HorizontalMax(mv);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

void SoftmaxPrefixAvx2(float* row, int n, int total) {
  const float m = MaxOfAvx2(row, n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mv));
    acc = _mm256_add_ps(acc, e);
    _mm256_storeu_ps(row + i, e);
  }
  float sum = HorizontalSum(acc);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - m);
    sum += row[i];
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), inv));
  }
  const float inv_s = 1.f / sum;
  for (; i < n; ++i) row[i] *= inv_s;
  std::fill(row + n, row + total, 0.f);
}

#define SPECSERVE_AVX512_SOFTMAX __attribute__((target("avx512f")))

// Exp8's operations on 16 lanes, in the same order: both paths give the
// same bits for the same input (the AVX2 path's scalar tail uses std::exp,
// within ~1e-7 of it).
SPECSERVE_AVX512_SOFTMAX inline __m512 Exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f);
  const __m512 lo = _mm512_set1_ps(-88.3762626647949f);
  const __mmask16 above_lo = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_cvtps_epi32(n);
  e = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(above_lo, p, _mm512_castsi512_ps(e));
}

SPECSERVE_AVX512_SOFTMAX float MaxOfAvx512(const float* x, int n) {
  if (n < 16) return MaxOfAvx2(x, n);
  // Max is exact and order-free: the same result as the AVX2 path.
  __m512 mv = _mm512_loadu_ps(x);
  int i = 16;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, x + i));
  }
  return _mm512_reduce_max_ps(mv);
}

// The AVX2 path's operations; the sum's association differs (16 lanes), so
// the normaliser may differ in the last bit.
SPECSERVE_AVX512_SOFTMAX void SoftmaxPrefixAvx512(float* row, int n,
                                                  int total) {
  const float m = MaxOfAvx512(row, n);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), mv));
    acc = _mm512_add_ps(acc, e);
    _mm512_storeu_ps(row + i, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        tail, Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + i), mv)));
    acc = _mm512_add_ps(acc, e);
    _mm512_mask_storeu_ps(row + i, tail, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(acc));
  for (i = 0; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(row + i, tail,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + i),
                                        inv));
  }
  std::fill(row + n, row + total, 0.f);
}

}  // namespace

float MaxOf(const float* x, int n) {
  return UseAvx512() ? MaxOfAvx512(x, n) : MaxOfAvx2(x, n);
}

void ExpInPlace(float* x, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

void SoftmaxPrefix(float* row, int n, int total) {
  if (UseAvx512()) {
    SoftmaxPrefixAvx512(row, n, total);
  } else {
    SoftmaxPrefixAvx2(row, n, total);
  }
}

namespace {

bool DetectAvx512() {
  if (std::getenv("SPECSERVE_DISABLE_AVX512") != nullptr) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

}  // namespace

bool UseAvx512() {
  static const bool use = DetectAvx512();
  return use;
}

// ---- Packed panels: skinny GEMMs as outer products. ----

void PackPanels(const float* w, int out, int in, float* packed) {
  const int panels = (out + kPanelWidth - 1) / kPanelWidth;
  for (int p = 0; p < panels; ++p) {
    float* dst = packed + static_cast<size_t>(p) * in * kPanelWidth;
    for (int k = 0; k < in; ++k) {
      for (int j = 0; j < kPanelWidth; ++j) {
        const int o = p * kPanelWidth + j;
        dst[static_cast<size_t>(k) * kPanelWidth + j] =
            o < out ? w[static_cast<size_t>(o) * in + k] : 0.f;
      }
    }
  }
}

namespace {

// Stores one row's kPanelWidth accumulated outputs (only the `valid` first
// ones: the last panel may be padding) as y = acc + beta * y; beta 0 never
// reads y. Vectorised for whole panels: at 16 rows the scalar loop cost
// ~3% of a decode step.
inline void StorePanelRow(const float* acc, int valid, float beta, float* y) {
  if (valid == kPanelWidth) {  // the same arithmetic as the loop below
    const __m256 b = _mm256_set1_ps(beta);
    for (int j = 0; j < kPanelWidth; j += 8) {
      const __m256 old = beta == 0.f
                             ? _mm256_setzero_ps()
                             : _mm256_mul_ps(b, _mm256_loadu_ps(y + j));
      _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(acc + j), old));
    }
    return;
  }
  for (int j = 0; j < valid; ++j) {
    y[j] = acc[j] + (beta == 0.f ? 0.f : beta * y[j]);
  }
}

// Rows of one PanelGemm pass: the panel is walked in blocks of kKBlock k's
// (16 KB of weights, L1-resident) and every group of rows runs over a block
// before the next block is touched, so each weight comes from memory once
// per call whatever the row count; the groups' re-reads hit L1. Accumulators
// live in a [rows][32] scratch between blocks (a few loads and stores per
// 128 k's). Each row's sums are still in ascending k, so results equal the
// unblocked kernel's bit for bit and do not depend on the other rows.
//
// The next block (or the next panel, which follows in memory) is
// prefetched while this one is computed, spread over the block's groups:
// one group alone requests both lines of each k ahead; with two or more,
// the first two request one half each, one line per k. Requests then leave
// at the pace of the arithmetic (memory and compute overlap); issuing the
// whole block from the first group stalls it on full fill buffers while
// memory idles during the others. The prefetches go to L2 (T1), from where
// the block's first group reads it into L1: ~5% faster at 16 rows than
// prefetching into L1 in a kernel-only benchmark.
constexpr int kKBlock = 128;
// Rows per pass: bounds the accumulator scratch (32 KB).
constexpr int kMaxPassRows = 256;
// Floats per 64-byte cache line.
constexpr int kLineFloats = 16;

// Prefetches kLines cache lines from `p` on into L2; returns the address
// after them.
template <int kLines>
inline const float* PrefetchLines(const float* p) {
  for (int i = 0; i < kLines; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i * kLineFloats),
                 _MM_HINT_T1);
  }
  return p + kLines * kLineFloats;
}

// Runs Rows<R, kPrefetchLines>::Run for a runtime prefetch mode (0, 1 or 2
// lines of the next block per k).
template <template <int, int> class Rows, int R>
inline void RunGroup(int prefetch_lines, const float* x, int in,
                     const float* panel, int k0, int k1, float* acc,
                     bool first, const float* prefetch) {
  switch (prefetch_lines) {
    case 2:
      Rows<R, 2>::Run(x, in, panel, k0, k1, acc, first, prefetch);
      break;
    case 1:
      Rows<R, 1>::Run(x, in, panel, k0, k1, acc, first, prefetch);
      break;
    default:
      Rows<R, 0>::Run(x, in, panel, k0, k1, acc, first, prefetch);
      break;
  }
}

// How a pass splits its rows: groups of kGroup rows, then the remainder in
// groups of 4, 3, 2 or 1 (as (first row, rows)). Made once per pass; every
// k-block of every panel runs the same groups.
struct RowGroups {
  RowGroups(int n, int group) {
    int r = 0;
    for (; r + group <= n; r += group) Add(r, group);
    for (int g : {4, 3, 2, 1}) {
      if (g < group && n - r >= g) {
        Add(r, g);
        r += g;
      }
    }
  }
  void Add(int start, int rows) {
    starts[count] = start;
    sizes[count++] = rows;
  }
  // Groups have >= 2 rows but the last few.
  int starts[kMaxPassRows / 2 + 4], sizes[kMaxPassRows / 2 + 4];
  int count = 0;
};

// One k-block [k0, k1) of a panel for the rows of `row_groups` (Rows<R,
// P>::Run accumulates R rows into acc [R][32]); each group is given its
// share of the next block's prefetch.
template <int kGroup, template <int, int> class Rows>
inline void PanelBlock(const float* x, const RowGroups& row_groups, int in,
                       const float* panel, int k0, int k1, float* acc) {
  const int groups = row_groups.count;
  const int* starts = row_groups.starts;
  const int* sizes = row_groups.sizes;
  const bool first = k0 == 0;
  const float* next = panel + size_t(k1) * kPanelWidth;
  for (int g = 0; g < groups; ++g) {
    const int lines = groups == 1 ? 2 : (g < 2 ? 1 : 0);
    const float* pf = next + size_t(g % 2) * kKBlock * kLineFloats;
    const float* xg = x + size_t(starts[g]) * in;
    float* ag = acc + size_t(starts[g]) * kPanelWidth;
    switch (sizes[g]) {
      case 8:
        if constexpr (kGroup >= 8) {
          RunGroup<Rows, 8>(lines, xg, in, panel, k0, k1, ag, first, pf);
        }
        break;
      case 4:
        if constexpr (kGroup >= 4) {
          RunGroup<Rows, 4>(lines, xg, in, panel, k0, k1, ag, first, pf);
        }
        break;
      case 3:
        if constexpr (kGroup >= 3) {
          RunGroup<Rows, 3>(lines, xg, in, panel, k0, k1, ag, first, pf);
        }
        break;
      case 2:
        RunGroup<Rows, 2>(lines, xg, in, panel, k0, k1, ag, first, pf);
        break;
      default:
        RunGroup<Rows, 1>(lines, xg, in, panel, k0, k1, ag, first, pf);
        break;
    }
  }
}

// Runs one PanelGemm pass of n <= kMaxPassRows rows over panels
// [panel_begin, panel_end).
template <int kGroup, template <int, int> class Rows>
inline void PanelPass(const float* x, int n, int in, const float* packed,
                      int panel_begin, int panel_end, float* y, int y_stride,
                      int out, float beta) {
  static_assert(kGroup >= 2, "RowGroups has room for kMaxPassRows / 2 + 4");
  alignas(64) float acc[kMaxPassRows * kPanelWidth];
  if (in == 0) std::fill(acc, acc + size_t(n) * kPanelWidth, 0.f);
  const RowGroups groups(n, kGroup);
  for (int p = panel_begin; p < panel_end; ++p) {
    const float* panel = packed + size_t(p) * in * kPanelWidth;
    for (int k0 = 0; k0 < in; k0 += kKBlock) {
      PanelBlock<kGroup, Rows>(x, groups, in, panel, k0,
                               std::min(in, k0 + kKBlock), acc);
    }
    const int o = p * kPanelWidth;
    const int valid = std::min(kPanelWidth, out - o);
    for (int r = 0; r < n; ++r) {
      StorePanelRow(acc + size_t(r) * kPanelWidth, valid, beta,
                    y + size_t(r) * y_stride + o);
    }
  }
}

// Splits n rows into passes of at most kMaxPassRows.
template <int kGroup, template <int, int> class Rows>
inline void PanelGemmImpl(const float* x, int n, int in, const float* packed,
                          int panel_begin, int panel_end, float* y,
                          int y_stride, int out, float beta) {
  for (int r = 0; r < n; r += kMaxPassRows) {
    PanelPass<kGroup, Rows>(x + size_t(r) * in, std::min(kMaxPassRows, n - r),
                            in, packed, panel_begin, panel_end,
                            y + size_t(r) * y_stride, y_stride, out, beta);
  }
}

#define SPECSERVE_AVX512 __attribute__((target("avx512f")))

// AVX-512: R rows of x against one k-block of a panel: per k, the panel's
// 32 weights (2 zmm) times each row's x[k] broadcast; 2R accumulators
// (R <= 8: 16 zmm). Requests kPrefetchLines lines from `prefetch` on per k.
template <int R, int kPrefetchLines>
struct RowsZ {
  SPECSERVE_AVX512 static void Run(const float* x, int in, const float* panel,
                                   int k0, int k1, float* acc, bool first,
                                   const float* prefetch) {
    __m512 a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      a[r][0] = first ? _mm512_setzero_ps()
                      : _mm512_load_ps(acc + r * kPanelWidth);
      a[r][1] = first ? _mm512_setzero_ps()
                      : _mm512_load_ps(acc + r * kPanelWidth + 16);
    }
    for (int k = k0; k < k1; ++k) {
      const float* wk = panel + size_t(k) * kPanelWidth;
      prefetch = PrefetchLines<kPrefetchLines>(prefetch);
      const __m512 w0 = _mm512_loadu_ps(wk);
      const __m512 w1 = _mm512_loadu_ps(wk + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[size_t(r) * in + k]);
        a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(acc + r * kPanelWidth, a[r][0]);
      _mm512_store_ps(acc + r * kPanelWidth + 16, a[r][1]);
    }
  }
};

SPECSERVE_AVX512 void PanelGemmAvx512(const float* x, int n, int in,
                                      const float* packed, int panel_begin,
                                      int panel_end, float* y, int y_stride,
                                      int out, float beta) {
  PanelGemmImpl<8, RowsZ>(x, n, in, packed, panel_begin, panel_end, y,
                          y_stride, out, beta);
}

#undef SPECSERVE_AVX512

// AVX2: a panel row is 4 ymm; 2 rows at a time (8 accumulators). Requests
// kPrefetchLines lines from `prefetch` on per k.
template <int R, int kPrefetchLines>
struct RowsY {
  static void Run(const float* x, int in, const float* panel, int k0, int k1,
                  float* acc, bool first, const float* prefetch) {
    __m256 a[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) {
        a[r][c] = first ? _mm256_setzero_ps()
                        : _mm256_load_ps(acc + r * kPanelWidth + 8 * c);
      }
    }
    for (int k = k0; k < k1; ++k) {
      const float* wk = panel + size_t(k) * kPanelWidth;
      prefetch = PrefetchLines<kPrefetchLines>(prefetch);
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(x[size_t(r) * in + k]);
        a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(w2, xb, a[r][2]);
        a[r][3] = _mm256_fmadd_ps(w3, xb, a[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) {
        _mm256_store_ps(acc + r * kPanelWidth + 8 * c, a[r][c]);
      }
    }
  }
};

}  // namespace

void PanelGemmAvx2(const float* x, int n, int in, const float* packed,
                   int panel_begin, int panel_end, float* y, int y_stride,
                   int out, float beta) {
  PanelGemmImpl<2, RowsY>(x, n, in, packed, panel_begin, panel_end, y,
                          y_stride, out, beta);
}

void PanelGemm(const float* x, int n, int in, const float* packed,
               int panel_begin, int panel_end, float* y, int y_stride, int out,
               float beta) {
  if (UseAvx512()) {
    PanelGemmAvx512(x, n, in, packed, panel_begin, panel_end, y, y_stride, out,
                    beta);
  } else {
    PanelGemmAvx2(x, n, in, packed, panel_begin, panel_end, y, y_stride, out,
                  beta);
  }
}

namespace {

// The 8 sums of a[0..7]'s lanes, as one vector: out[t] = sum(a[t]).
inline __m256 Sum8x8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                   _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]),
                                   _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                       _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Key-major passes over a sequence's cached keys and values: for a chunk
// of 8 tokens, every head's work on those tokens, then the next chunk. A
// token's K (or V) row holds all KV heads side by side, and a block's rows
// are contiguous, so the cache streams sequentially through memory (the
// hardware prefetcher follows it) instead of in one strided pass per head.
// Each (head, token) result is computed exactly as a per-head pass would
// (same operations in the same order), so results do not change.
// Both read an f32 cache or a bf16 one (T = uint16_t, widened to f32 8 at
// a time by Load8) with the same f32 arithmetic: a bf16 cache gives
// exactly the f32 result on the bf16-rounded keys and values.

// 8 cache elements widened to f32: f32 as is; bf16 (the top half of an
// f32) zero-extended to 32 bits and shifted into the high half, exact.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// scores[h * stride + j] = (q_h . key_j[kv head of h]) * scale for heads
// h < H and tokens j < nk; q_h = qi + h * D.
template <typename T, typename SlotFn>
void ScoresAllHeads(const float* qi, const T* k, size_t kv_stride, int H,
                    int group, int D, int nk, float scale, const SlotFn& slot,
                    float* scores, size_t stride) {
  const int dv = D & ~7;
  int j = 0;
  for (; j + 8 <= nk; j += 8) {
    const T* kj[8];
    for (int t = 0; t < 8; ++t) kj[t] = k + slot(j + t) * kv_stride;
    for (int h = 0; h < H; ++h) {
      const float* qh = qi + size_t(h) * D;
      const size_t off = size_t(h / group) * D;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int d = 0; d < dv; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          acc[t] =
              _mm256_fmadd_ps(qv, Load8(kj[t] + off + d), acc[t]);
        }
      }
      float* sh = scores + size_t(h) * stride;
      _mm256_storeu_ps(sh + j,
                       _mm256_mul_ps(Sum8x8(acc), _mm256_set1_ps(scale)));
      if (dv < D) {
        for (int t = 0; t < 8; ++t) {
          float tail = 0.f;
          for (int d = dv; d < D; ++d) tail += qh[d] * ToFloat(kj[t][off + d]);
          sh[j + t] += tail * scale;
        }
      }
    }
  }
  for (; j < nk; ++j) {
    const T* kj = k + slot(j) * kv_stride;
    for (int h = 0; h < H; ++h) {
      const float* qh = qi + size_t(h) * D;
      const T* kh = kj + size_t(h / group) * D;
      __m256 acc = _mm256_setzero_ps();
      for (int d = 0; d < dv; d += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d),
                              Load8(kh + d), acc);
      }
      float sum = HorizontalSum(acc);
      for (int d = dv; d < D; ++d) sum += qh[d] * ToFloat(kh[d]);
      scores[size_t(h) * stride + j] = sum * scale;
    }
  }
}

// out[h * D + d] = sum_j p[h * stride + j] * value_j[kv head of h][d] for
// heads h < H and tokens j < nk. Per chunk of 8 tokens and per head, the
// head's 64-float pieces of `out` stay in registers across the chunk.
template <typename T, typename SlotFn>
void WeightedValuesAllHeads(const float* p, size_t stride, const T* v,
                            size_t kv_stride, int H, int group, int D, int nk,
                            const SlotFn& slot, float* out) {
  std::fill(out, out + size_t(H) * D, 0.f);
  for (int j = 0; j < nk; j += 8) {
    const int count = std::min(8, nk - j);
    const T* vj[8];
    for (int t = 0; t < count; ++t) vj[t] = v + slot(j + t) * kv_stride;
    for (int h = 0; h < H; ++h) {
      const float* ph = p + size_t(h) * stride + j;
      const size_t off = size_t(h / group) * D;
      float* oh = out + size_t(h) * D;
      for (int d0 = 0; d0 < D; d0 += 64) {
        const int width = std::min(64, D - d0);
        const int nv = width / 8;
        __m256 acc[8];
        for (int c = 0; c < nv; ++c) acc[c] = _mm256_loadu_ps(oh + d0 + 8 * c);
        for (int t = 0; t < count; ++t) {
          const T* vt = vj[t] + off + d0;
          const __m256 pt = _mm256_set1_ps(ph[t]);
          if (nv == 8) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
              acc[c] = _mm256_fmadd_ps(pt, Load8(vt + 8 * c), acc[c]);
            }
          } else {
            for (int c = 0; c < nv; ++c) {
              acc[c] = _mm256_fmadd_ps(pt, Load8(vt + 8 * c), acc[c]);
            }
            for (int d = 8 * nv; d < width; ++d) oh[d0 + d] += ph[t] * ToFloat(vt[d]);
          }
        }
        for (int c = 0; c < nv; ++c) _mm256_storeu_ps(oh + d0 + 8 * c, acc[c]);
      }
    }
  }
}

}  // namespace

void MaskScores(float* row, const int* keys, int count) {
  for (int j = 0; j < count; ++j) row[keys[j]] = -INFINITY;
}

namespace {

template <typename T>
void AttentionRowsImpl(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const T* k, const T* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride,
                   const int* mask_offsets, const int* mask_keys) {
  const int group = num_heads / num_kv_heads;
  const int D = head_dim;
  const size_t stride = size_t(first) + rows;  // per head in `scores`
  // Physical rows of the logical slots, once per call: computed per key
  // and per row (a division and a modulo each, in both passes) they cost
  // more than the arithmetic on a small head_dim.
  thread_local std::vector<size_t> slots;
  const int total = first + rows;
  slots.resize(total);
  for (int j = 0, b = 0; j < total; ++b) {
    const size_t base = size_t(block_table[b]) * block_size;
    for (int o = 0; o < block_size && j < total; ++o) slots[j++] = base + o;
  }
  const size_t* slot_of = slots.data();
  auto slot = [slot_of](int j) { return slot_of[j]; };
  for (int i = 0; i < rows; ++i) {
    const int nk = first + i + 1;  // causal over cache order
    const float* qi = q + size_t(i) * q_stride;
    ScoresAllHeads(qi, k, kv_stride, num_heads, group, D, nk, scale, slot,
                   scores, stride);
    if (mask_offsets != nullptr && mask_offsets[i + 1] > mask_offsets[i]) {
      for (int h = 0; h < num_heads; ++h) {
        MaskScores(scores + size_t(h) * stride, mask_keys + mask_offsets[i],
                   mask_offsets[i + 1] - mask_offsets[i]);
      }
    }
    for (int h = 0; h < num_heads; ++h) {
      SoftmaxPrefix(scores + size_t(h) * stride, nk, nk);
    }
    WeightedValuesAllHeads(scores, stride, v, kv_stride, num_heads, group, D,
                           nk, slot, out + size_t(i) * out_stride);
  }
}

}  // namespace

void AttentionRows(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const float* k, const float* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride,
                   const int* mask_offsets, const int* mask_keys) {
  AttentionRowsImpl(q, q_stride, rows, first, num_heads, num_kv_heads,
                    head_dim, k, v, kv_stride, block_table, block_size, scale,
                    scores, out, out_stride, mask_offsets, mask_keys);
}

void AttentionRows(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const uint16_t* k, const uint16_t* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride,
                   const int* mask_offsets, const int* mask_keys) {
  AttentionRowsImpl(q, q_stride, rows, first, num_heads, num_kv_heads,
                    head_dim, k, v, kv_stride, block_table, block_size, scale,
                    scores, out, out_stride, mask_offsets, mask_keys);
}

void FloatToBf16Row(const float* x, size_t n, uint16_t* out) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(x + i);
    const __m256i u = _mm256_castps_si256(f);
    // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the
    // top half. NaN lanes are made quiet instead, so that rounding cannot
    // carry a NaN's payload into infinity.
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, lsb));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
    r = _mm256_srli_epi32(r, 16);
    // 8 lanes < 2^16 to 8 uint16 in order (packus works per 128-bit half).
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                            _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], sizeof(u));
    out[i] = std::isnan(x[i])
                 ? static_cast<uint16_t>((u | 0x00400000u) >> 16)
                 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

void Bf16ToFloatRow(const uint16_t* x, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, Load8(x + i));
  for (; i < n; ++i) out[i] = ToFloat(x[i]);
}

}  // namespace kernels
}  // namespace specserve
