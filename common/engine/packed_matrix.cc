#include "common/engine/packed_matrix.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/engine/huge_page_arena.h"
#include "common/engine/kernels.h"
#include "common/engine/thread_pool.h"
#include "common/model/safetensors.h"

namespace specserve {
namespace {

constexpr int kW = kernels::kPanelWidth;  // 32
constexpr int kQBlock = 32;               // int8 weights per scale
// Below this many multiply-adds a product runs on the calling thread.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;
// Floats of one f32 tile prefill's sgemm reads (4 MiB).
constexpr size_t kTileFloats = size_t{1} << 20;

bool HasAvx512Bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return kernels::UseAvx512() && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

bool HasAvx512Vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return kernels::UseAvx512() && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

int RoundUp(int v, int m) { return (v + m - 1) / m * m; }

// bf16 bits of f, round to nearest even (inputs are finite).
inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even (the default MXCSR mode): one cvtss2si,
// where std::nearbyint is a libm call.
inline int RoundToInt(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

// Quantizes 32 floats as one int8 block: d = absmax / 127, q = round(x /
// d); writes q, d and -128 * sum(q) (the bias vpdpbusd's unsigned weights
// need). The same arithmetic as the scalar tail loop, 8 lanes at a time.
inline void QuantizeBlock(const float* x, int8_t* q, float* scale,
                          int32_t* bias) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i qi[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // Saturating packs interleave 128-bit lanes; the permute restores order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                       _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(
                          p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum),
                             _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *scale = d;
  *bias = -128 * _mm_cvtsi128_si32(s4);
}

// Stores one row's accumulated outputs: y = acc + beta * y for the `valid`
// first of 32; beta 0 never reads y.
inline void StoreRow(const float* acc, int valid, float beta, float* y) {
  if (beta == 0.f) {
    std::memcpy(y, acc, valid * sizeof(float));
  } else {
    for (int j = 0; j < valid; ++j) y[j] = acc[j] + beta * y[j];
  }
}

// ---- bf16 ----

#define SPECSERVE_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// R rows of bf16 pairs xp (row stride xs pairs) against one bf16 panel of
// kp pairs of k: acc[r][32].
template <int R>
SPECSERVE_BF16 void Bf16RowsZ(const uint32_t* xp, size_t xs, int kp,
                              const uint16_t* panel, float* acc) {
  __m512 a[R][2];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < kp; ++k) {
    const uint16_t* wk = panel + size_t(k) * 2 * kW;
    const __m512i w0 = _mm512_loadu_si512(wk);
    const __m512i w1 = _mm512_loadu_si512(wk + kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[r * xs + k]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)w0, (__m512bh)xb);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)w1, (__m512bh)xb);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * kW, a[r][0]);
    _mm512_storeu_ps(acc + r * kW + 16, a[r][1]);
  }
}

SPECSERVE_BF16 void Bf16GroupZ(int rows, const uint32_t* xp, size_t xs, int kp,
                               const uint16_t* panel, float* acc) {
  switch (rows) {
    case 8:
      return Bf16RowsZ<8>(xp, xs, kp, panel, acc);
    case 7:
      return Bf16RowsZ<7>(xp, xs, kp, panel, acc);
    case 6:
      return Bf16RowsZ<6>(xp, xs, kp, panel, acc);
    case 5:
      return Bf16RowsZ<5>(xp, xs, kp, panel, acc);
    case 4:
      return Bf16RowsZ<4>(xp, xs, kp, panel, acc);
    case 3:
      return Bf16RowsZ<3>(xp, xs, kp, panel, acc);
    case 2:
      return Bf16RowsZ<2>(xp, xs, kp, panel, acc);
    default:
      return Bf16RowsZ<1>(xp, xs, kp, panel, acc);
  }
}

#undef SPECSERVE_BF16

// AVX2: bf16 widened to f32 (a pair's even k is the low half: shift left
// 16; the odd k the high half: mask), f32 x (row stride xs floats).
template <int R>
void Bf16RowsY(const float* x, size_t xs, int kp, const uint16_t* panel,
               float* acc) {
  __m256 a[R][4];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  }
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int k = 0; k < kp; ++k) {
    const uint16_t* wk = panel + size_t(k) * 2 * kW;
    __m256 xe[R], xo[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xe[r] = _mm256_set1_ps(x[r * xs + 2 * k]);
      xo[r] = _mm256_set1_ps(x[r * xs + 2 * k + 1]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * c));
      const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[r][c] = _mm256_fmadd_ps(e, xe[r], a[r][c]);
        a[r][c] = _mm256_fmadd_ps(o, xo[r], a[r][c]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * kW + 8 * c, a[r][c]);
  }
}

// ---- int8 ----

#define SPECSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// R rows of int8 x (row stride xs bytes; per-block scales / biases with
// row stride bs) against one int8 panel of nb blocks: per 4 k, vpdpbusd of
// the panel's unsigned q + 128 with the row's signed quad; a block's
// integer sum starts at -128 * sum(x block) so it equals sum(q * x).
template <int R>
SPECSERVE_VNNI void Q8RowsZ(const int8_t* xq, size_t xs, const float* xsc,
                            const int32_t* xbias, size_t bs, int nb,
                            const uint8_t* panel, const uint16_t* scales,
                            float* acc) {
  __m512 f[R][2];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512i s[R][2];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      s[r][0] = s[r][1] = _mm512_set1_epi32(xbias[r * bs + b]);
    }
    const uint8_t* pb = panel + size_t(b) * kQBlock * kW;
#pragma GCC unroll 8
    for (int q = 0; q < kQBlock / 4; ++q) {
      const __m512i w0 = _mm512_loadu_si512(pb + q * 4 * kW);
      const __m512i w1 = _mm512_loadu_si512(pb + q * 4 * kW + 64);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * xs + b * kQBlock + 4 * q, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xb);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xb);
      }
    }
    const uint16_t* sc = scales + size_t(b) * kW;
    const __m512 ws0 = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    const __m512 ws1 = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(xsc[r * bs + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]),
                                _mm512_mul_ps(ws0, d), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]),
                                _mm512_mul_ps(ws1, d), f[r][1]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * kW, f[r][0]);
    _mm512_storeu_ps(acc + r * kW + 16, f[r][1]);
  }
}

SPECSERVE_VNNI void Q8GroupZ(int rows, const int8_t* xq, size_t xs,
                             const float* xsc, const int32_t* xbias, size_t bs,
                             int nb, const uint8_t* panel,
                             const uint16_t* scales, float* acc) {
  switch (rows) {
    case 4:
      return Q8RowsZ<4>(xq, xs, xsc, xbias, bs, nb, panel, scales, acc);
    case 3:
      return Q8RowsZ<3>(xq, xs, xsc, xbias, bs, nb, panel, scales, acc);
    case 2:
      return Q8RowsZ<2>(xq, xs, xsc, xbias, bs, nb, panel, scales, acc);
    default:
      return Q8RowsZ<1>(xq, xs, xsc, xbias, bs, nb, panel, scales, acc);
  }
}

#undef SPECSERVE_VNNI

// AVX2: one f32 row x against one int8 panel, the weights widened to f32
// (byte j of each 32-bit lane is k + j); per block, sum((q + 128) x) -
// 128 sum(x) times the 32 scales.
void Q8RowY(const float* x, int nb, const uint8_t* panel,
            const uint16_t* scales, float* acc) {
  __m256 f[4];
  for (int c = 0; c < 4; ++c) f[c] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0xff);
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + b * kQBlock;
    __m256 s[4];
    for (int c = 0; c < 4; ++c) s[c] = _mm256_setzero_ps();
    const uint8_t* pb = panel + size_t(b) * kQBlock * kW;
    for (int q = 0; q < kQBlock / 4; ++q) {
      const __m256 x0 = _mm256_set1_ps(xb[4 * q]);
      const __m256 x1 = _mm256_set1_ps(xb[4 * q + 1]);
      const __m256 x2 = _mm256_set1_ps(xb[4 * q + 2]);
      const __m256 x3 = _mm256_set1_ps(xb[4 * q + 3]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(pb + q * 4 * kW + 32 * c));
        s[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), x0,
                               s[c]);
        s[c] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), low)),
            x1, s[c]);
        s[c] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), low)),
            x2, s[c]);
        s[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 24)), x3,
                               s[c]);
      }
    }
    float sum = 0.f;
    for (int i = 0; i < kQBlock; ++i) sum += xb[i];
    const __m256 bias = _mm256_set1_ps(-128.f * sum);
    const uint16_t* sc = scales + size_t(b) * kW;
    for (int c = 0; c < 4; ++c) {
      const __m256 ws = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * c)));
      f[c] = _mm256_fmadd_ps(_mm256_add_ps(s[c], bias), ws, f[c]);
    }
  }
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + 8 * c, f[c]);
}

}  // namespace

std::string WeightDTypeName(WeightDType t) {
  switch (t) {
    case WeightDType::kF32:
      return "f32";
    case WeightDType::kBF16:
      return "bf16";
    case WeightDType::kInt8:
      return "int8";
  }
  return "?";
}

absl::StatusOr<std::optional<WeightDType>> ParseWeightDType(
    const std::string& s) {
  const std::string v = absl::AsciiStrToLower(s);
  if (v.empty() || v == "auto") return std::optional<WeightDType>();
  if (v == "f32" || v == "fp32" || v == "float32") return WeightDType::kF32;
  if (v == "bf16" || v == "bfloat16") return WeightDType::kBF16;
  if (v == "int8" || v == "q8_0") return WeightDType::kInt8;
  return absl::InvalidArgumentError(absl::StrCat(
      "weight_dtype must be auto, f32, bf16 or int8, got \"", s, "\""));
}

std::string PackedKernelName(WeightDType t) {
  switch (t) {
    case WeightDType::kF32:
      return kernels::UseAvx512() ? "avx512" : "avx2";
    case WeightDType::kBF16:
      return HasAvx512Bf16() ? "avx512bf16" : "avx2";
    case WeightDType::kInt8:
      return HasAvx512Vnni() ? "avx512vnni" : "avx2";
  }
  return "?";
}

PackedMatrix PackedMatrix::Allocate(int out, int in, WeightDType dtype) {
  PackedMatrix m;
  m.dtype_ = dtype;
  m.out_ = out;
  m.in_ = in;
  m.panels_ = (out + kW - 1) / kW;
  const size_t P = m.panels_;
  HugePageArena& arena = HugePageArena::Default();
  switch (dtype) {
    case WeightDType::kF32: {
      m.in_padded_ = in;
      const size_t n = kernels::PackedPanelFloats(out, in);
      m.f32_ = arena.AllocateArray<float>(n);
      m.bytes_ = n * sizeof(float);
      break;
    }
    case WeightDType::kBF16: {
      m.in_padded_ = RoundUp(in, 2);
      const size_t n = P * m.in_padded_ * kW;
      m.bf16_ = arena.AllocateArray<uint16_t>(n);  // zeros: the padding
      m.bytes_ = n * sizeof(uint16_t);
      break;
    }
    case WeightDType::kInt8: {
      m.in_padded_ = RoundUp(in, kQBlock);
      const int nb = m.in_padded_ / kQBlock;
      const size_t n = P * m.in_padded_ * kW;
      m.q8_ = arena.AllocateArray<uint8_t>(n);
      std::memset(m.q8_.get(), 128, n);  // q = 0
      m.scales_ = arena.AllocateArray<uint16_t>(P * nb * kW);
      m.bytes_ = n + P * nb * kW * sizeof(uint16_t);
      break;
    }
  }
  return m;
}

void PackedMatrix::PackPanel(const float* rows, int valid, int p) {
  const int in = in_;
  const int ip = in_padded_;
  switch (dtype_) {
    case WeightDType::kF32: {
      float* dst = f32_.get() + size_t(p) * in * kW;
      for (int k = 0; k < in; ++k) {
        for (int j = 0; j < kW; ++j) {
          dst[size_t(k) * kW + j] = j < valid ? rows[size_t(j) * in + k] : 0.f;
        }
      }
      return;
    }
    case WeightDType::kBF16: {
      uint16_t* panel = bf16_.get() + size_t(p) * ip * kW;
      for (int c = 0; c < valid; ++c) {
        const float* row = rows + size_t(c) * in;
        for (int k = 0; k < in; ++k) {
          panel[size_t(k / 2) * 2 * kW + c * 2 + (k & 1)] = ToBf16(row[k]);
        }
      }
      return;
    }
    case WeightDType::kInt8: {
      const int nb = ip / kQBlock;
      uint8_t* panel = q8_.get() + size_t(p) * ip * kW;
      uint16_t* scales = scales_.get() + size_t(p) * nb * kW;
      for (int c = 0; c < valid; ++c) {
        const float* row = rows + size_t(c) * in;
        for (int b = 0; b < nb; ++b) {
          const int k0 = b * kQBlock, k1 = std::min(in, k0 + kQBlock);
          float amax = 0.f;
          for (int k = k0; k < k1; ++k)
            amax = std::max(amax, std::fabs(row[k]));
          const uint16_t h = FloatToHalf(amax / 127.f);
          scales[b * kW + c] = h;
          const float d = HalfToFloat(h);
          const float id = d > 0.f ? 1.f / d : 0.f;
          for (int k = k0; k < k1; ++k) {
            const int q = std::clamp(RoundToInt(row[k] * id), -127, 127);
            panel[size_t(k / 4) * 4 * kW + c * 4 + (k & 3)] =
                static_cast<uint8_t>(q + 128);
          }
        }
      }
      return;
    }
  }
}

PackedMatrix PackedMatrix::Pack(const float* w, int out, int in,
                                WeightDType dtype) {
  PackedMatrix m = Allocate(out, in, dtype);
  for (int p = 0; p < m.panels_; ++p) {
    m.PackPanel(w + size_t(p) * kW * in, std::min(kW, out - p * kW), p);
  }
  return m;
}

PackedMatrix PackedMatrix::PackRows(const RowSource& rows, int out, int in,
                                    WeightDType dtype) {
  PackedMatrix m = Allocate(out, in, dtype);
  // A panel's rows (at most 32 x in floats) stay in L2 between the
  // conversion and the packing.
  ThreadPool::Default().ParallelFor(m.panels_, 1, [&](int begin, int end) {
    std::vector<float> tmp(size_t(kW) * in);
    for (int p = begin; p < end; ++p) {
      const int valid = std::min(kW, out - p * kW);
      rows(p * kW, p * kW + valid, tmp.data());
      m.PackPanel(tmp.data(), valid, p);
    }
  });
  return m;
}

bool PackedMatrix::HasNativeKernel() const {
  switch (dtype_) {
    case WeightDType::kF32:
      return false;
    case WeightDType::kBF16:
      return HasAvx512Bf16();
    case WeightDType::kInt8:
      return HasAvx512Vnni();
  }
  return false;
}

void PackedMatrix::PrepareInput(const float* x, int n, Input* input) const {
  input->x = x;
  input->n = n;
  const int ip = in_padded_;
  auto pad = [&] {
    input->padded.assign(size_t(n) * ip, 0.f);
    for (int r = 0; r < n; ++r) {
      std::memcpy(&input->padded[size_t(r) * ip], x + size_t(r) * in_,
                  in_ * sizeof(float));
    }
  };
  switch (dtype_) {
    case WeightDType::kF32:
      return;
    case WeightDType::kBF16:
      if (!HasAvx512Bf16()) return pad();
      input->pairs.resize(size_t(n) * ip / 2);
      for (int r = 0; r < n; ++r) {
        const float* xr = x + size_t(r) * in_;
        uint32_t* pr = &input->pairs[size_t(r) * ip / 2];
        for (int k = 0; k < ip; k += 2) {
          const uint32_t lo = ToBf16(xr[k]);
          const uint32_t hi = k + 1 < in_ ? ToBf16(xr[k + 1]) : 0;
          pr[k / 2] = lo | (hi << 16);
        }
      }
      return;
    case WeightDType::kInt8: {
      if (!HasAvx512Vnni()) return pad();
      const int nb = ip / kQBlock;
      input->q.assign(size_t(n) * ip, 0);
      input->scale.resize(size_t(n) * nb);
      input->bias.resize(size_t(n) * nb);
      for (int r = 0; r < n; ++r) {
        const float* xr = x + size_t(r) * in_;
        int8_t* qr = &input->q[size_t(r) * ip];
        for (int b = 0; b < nb; ++b) {
          const int k0 = b * kQBlock, k1 = std::min(in_, k0 + kQBlock);
          if (k1 - k0 == kQBlock) {
            QuantizeBlock(xr + k0, qr + k0, &input->scale[size_t(r) * nb + b],
                          &input->bias[size_t(r) * nb + b]);
            continue;
          }
          float amax = 0.f;
          for (int k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
          const float d = amax / 127.f;
          const float id = d > 0.f ? 1.f / d : 0.f;
          int32_t sum = 0;
          for (int k = k0; k < k1; ++k) {
            const int q = RoundToInt(xr[k] * id);
            qr[k] = static_cast<int8_t>(q);
            sum += q;
          }
          input->scale[size_t(r) * nb + b] = d;
          input->bias[size_t(r) * nb + b] = -128 * sum;
        }
      }
      return;
    }
  }
}

void PackedMatrix::Gemm(const Input& input, int panel_begin, int panel_end,
                        float* y, int y_stride, float beta) const {
  const int n = input.n;
  if (dtype_ == WeightDType::kF32) {
    kernels::PanelGemm(input.x, n, in_, f32_.get(), panel_begin, panel_end, y,
                       y_stride, out_, beta);
    return;
  }
  alignas(64) float acc[8 * kW];
  const int ip = in_padded_;
  for (int p = panel_begin; p < panel_end; ++p) {
    const int o = p * kW;
    const int valid = std::min(kW, out_ - o);
    auto store = [&](int r0, int rows) {
      for (int r = 0; r < rows; ++r) {
        StoreRow(acc + r * kW, valid, beta, y + size_t(r0 + r) * y_stride + o);
      }
    };
    if (dtype_ == WeightDType::kBF16) {
      const uint16_t* panel = bf16_.get() + size_t(p) * ip * kW;
      if (HasAvx512Bf16()) {
        for (int r0 = 0; r0 < n; r0 += 8) {
          const int rows = std::min(8, n - r0);
          Bf16GroupZ(rows, &input.pairs[size_t(r0) * ip / 2], ip / 2, ip / 2,
                     panel, acc);
          store(r0, rows);
        }
      } else {
        for (int r0 = 0; r0 < n; r0 += 2) {
          const int rows = std::min(2, n - r0);
          const float* xr = &input.padded[size_t(r0) * ip];
          if (rows == 2) {
            Bf16RowsY<2>(xr, ip, ip / 2, panel, acc);
          } else {
            Bf16RowsY<1>(xr, ip, ip / 2, panel, acc);
          }
          store(r0, rows);
        }
      }
    } else {
      const int nb = ip / kQBlock;
      const uint8_t* panel = q8_.get() + size_t(p) * ip * kW;
      const uint16_t* sc = scales_.get() + size_t(p) * nb * kW;
      if (HasAvx512Vnni()) {
        for (int r0 = 0; r0 < n; r0 += 4) {
          const int rows = std::min(4, n - r0);
          Q8GroupZ(rows, &input.q[size_t(r0) * ip], ip,
                   &input.scale[size_t(r0) * nb], &input.bias[size_t(r0) * nb],
                   nb, nb, panel, sc, acc);
          store(r0, rows);
        }
      } else {
        for (int r = 0; r < n; ++r) {
          Q8RowY(&input.padded[size_t(r) * ip], nb, panel, sc, acc);
          store(r, 1);
        }
      }
    }
  }
}

void PackedMatrix::UnpackPanels(int panel_begin, int panel_end, float* dst,
                                size_t ld) const {
  const int ip = in_padded_;
  for (int p = panel_begin; p < panel_end; ++p) {
    float* d = dst + size_t(p - panel_begin) * kW;
    switch (dtype_) {
      case WeightDType::kF32: {
        const float* panel = f32_.get() + size_t(p) * in_ * kW;
        for (int k = 0; k < in_; ++k) {
          std::memcpy(d + k * ld, panel + size_t(k) * kW, kW * sizeof(float));
        }
        break;
      }
      case WeightDType::kBF16: {
        const uint16_t* panel = bf16_.get() + size_t(p) * ip * kW;
        const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        for (int k = 0; k < in_; k += 2) {
          const uint16_t* wk = panel + size_t(k / 2) * 2 * kW;
          float* e = d + k * ld;
          float* o = d + (k + 1) * ld;
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(wk + 16 * c));
            _mm256_storeu_ps(e + 8 * c,
                             _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            if (k + 1 < in_) {
              _mm256_storeu_ps(o + 8 * c,
                               _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
            }
          }
        }
        break;
      }
      case WeightDType::kInt8: {
        const int nb = ip / kQBlock;
        const uint8_t* panel = q8_.get() + size_t(p) * ip * kW;
        const uint16_t* sc = scales_.get() + size_t(p) * nb * kW;
        const __m256i low = _mm256_set1_epi32(0xff);
        const __m256 off = _mm256_set1_ps(128.f);
        for (int b = 0; b < nb; ++b) {
          __m256 ws[4];
          for (int c = 0; c < 4; ++c) {
            ws[c] = _mm256_cvtph_ps(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(sc + b * kW + 8 * c)));
          }
          for (int k = b * kQBlock; k < std::min(in_, (b + 1) * kQBlock);
               k += 4) {
            const uint8_t* wk = panel + size_t(k / 4) * 4 * kW;
            for (int c = 0; c < 4; ++c) {
              const __m256i v = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(wk + 32 * c));
              for (int j = 0; j < 4 && k + j < in_; ++j) {
                const __m256i q =
                    _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), low);
                _mm256_storeu_ps(
                    d + (k + j) * ld + 8 * c,
                    _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), off),
                                  ws[c]));
              }
            }
          }
        }
        break;
      }
    }
  }
}

void PackedMatrix::DequantizeRow(int row, float* dst) const {
  const size_t p = row / kW;
  const int c = row % kW;
  const int ip = in_padded_;
  switch (dtype_) {
    case WeightDType::kF32: {
      const float* panel = f32_.get() + p * in_ * kW;
      for (int k = 0; k < in_; ++k) dst[k] = panel[size_t(k) * kW + c];
      return;
    }
    case WeightDType::kBF16: {
      const uint16_t* panel = bf16_.get() + p * ip * kW;
      for (int k = 0; k < in_; ++k) {
        dst[k] = Bf16ToF32(panel[size_t(k / 2) * 2 * kW + c * 2 + (k & 1)]);
      }
      return;
    }
    case WeightDType::kInt8: {
      const int nb = ip / kQBlock;
      const uint8_t* panel = q8_.get() + p * ip * kW;
      const uint16_t* sc = scales_.get() + p * nb * kW;
      for (int k = 0; k < in_; ++k) {
        const float d = HalfToFloat(sc[(k / kQBlock) * kW + c]);
        const int q = panel[size_t(k / 4) * 4 * kW + c * 4 + (k & 3)] - 128;
        dst[k] = d * static_cast<float>(q);
      }
      return;
    }
  }
}

void PackedLinear(const PackedMatrix& w, const float* x, int n, float* y,
                  float beta, int max_gemv_rows, PackedMatrix::Input* input) {
  const int out = w.out(), in = w.in(), panels = w.panels();
  // bf16 / int8 with their AVX-512 instructions do 2x / 4x the MACs per
  // instruction of f32 FMA, so they beat dequantize + sgemm at any n.
  if (n <= max_gemv_rows || w.HasNativeKernel()) {
    w.PrepareInput(x, n, input);
    // Waking the pool costs tens of microseconds: small weights (tiny
    // models, which fit in cache) run inline.
    if (static_cast<int64_t>(out) * in * n < kMinParallelMacs) {
      w.Gemm(*input, 0, panels, y, out, beta);
      return;
    }
    ThreadPool::Default().ParallelFor(
        panels, 1, [&](int b, int e) { w.Gemm(*input, b, e, y, out, beta); });
    return;
  }
  // Prefill: W^T tiles of whole panels, dequantized to f32 (spread over the
  // pool), each multiplied by OpenBLAS sgemm.
  thread_local std::vector<float> tile;
  const int per_tile = std::max<int>(
      1, std::min<size_t>(panels, kTileFloats / (size_t(kW) * in)));
  tile.resize(size_t(per_tile) * kW * in);
  float* t = tile.data();  // the calling thread's buffer, for the workers
  for (int p0 = 0; p0 < panels; p0 += per_tile) {
    const int p1 = std::min(panels, p0 + per_tile);
    const size_t ld = size_t(p1 - p0) * kW;
    ThreadPool::Default().ParallelFor(p1 - p0, 1, [&](int b, int e) {
      w.UnpackPanels(p0 + b, p0 + e, t + size_t(b) * kW, ld);
    });
    const int cols = std::min(out - p0 * kW, (p1 - p0) * kW);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, cols, in, 1.f, x,
                in, t, ld, beta, y + p0 * kW, out);
  }
}

}  // namespace specserve
