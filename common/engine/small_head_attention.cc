#include "common/engine/small_head_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/engine/kernels.h"

namespace specserve {
namespace kernels {
namespace {

#define SPECSERVE_SMALL_HEAD __attribute__((target("avx512f")))

constexpr int kChunk = 16;  // keys per step: one AVX-512 vector of scores
// Queries per KV head from which chunk-major chunks are copied before use.
constexpr int kCopyQueries = 8;

// Transposes 8 dimensions of one chunk's 16 tokens (token t's floats at
// base + off[t]) into dst[d * 16 + t]: two 8 x 8 transposes side by side
// in the vectors' 256-bit halves (unpack, shuffle, then one two-source
// permute per output), 16 loads and 24 shuffles where gathers would take
// 128 loads.
SPECSERVE_SMALL_HEAD void Transpose8(const float* base, const int32_t* off,
                                     float* dst) {
  __m512 z[8];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    // Masked forms with a defined source: GCC 12's unmasked intrinsics
    // start from an "undefined" vector and warn (-Wuninitialized).
    const __m256d lo = _mm256_castps_pd(_mm256_loadu_ps(base + off[i]));
    const __m256d hi = _mm256_castps_pd(_mm256_loadu_ps(base + off[i + 8]));
    z[i] = _mm512_castpd_ps(_mm512_mask_broadcast_f64x4(
        _mm512_maskz_broadcast_f64x4(0x0f, lo), 0xf0, hi));
  }
  __m512 t[8], u[8];
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_ps(0xffff, z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] =
        _mm512_maskz_unpackhi_ps(0xffff, z[2 * i], z[2 * i + 1]);
  }
#pragma GCC unroll 16
  for (int h = 0; h < 2; ++h) {  // rows 0-3 and 4-7 of each half
    const __m512* th = t + 4 * h;
    u[4 * h + 0] = _mm512_shuffle_ps(th[0], th[2], 0x44);
    u[4 * h + 1] = _mm512_shuffle_ps(th[0], th[2], 0xee);
    u[4 * h + 2] = _mm512_shuffle_ps(th[1], th[3], 0x44);
    u[4 * h + 3] = _mm512_shuffle_ps(th[1], th[3], 0xee);
  }
  // u[d] holds dimension d (128-bit lanes 0 and 2) and d + 4 (lanes 1, 3)
  // of rows 0-3 of each half; u[d + 4] the same of rows 4-7.
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                       11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                       15, 28, 29, 30, 31);
#pragma GCC unroll 16
  for (int d = 0; d < 4; ++d) {
    _mm512_storeu_ps(dst + d * kChunk,
                     _mm512_permutex2var_ps(u[d], lo, u[d + 4]));
    _mm512_storeu_ps(dst + (d + 4) * kChunk,
                     _mm512_permutex2var_ps(u[d], hi, u[d + 4]));
  }
}

// The lower and upper 256 bits of x (masked forms, see Transpose8: GCC
// 12's _mm512_castps512_ps256 is an unmasked extract).
SPECSERVE_SMALL_HEAD __m256 Low256(__m512 x) {
  return _mm256_castpd_ps(
      _mm512_maskz_extractf64x4_pd(0x0f, _mm512_castps_pd(x), 0));
}

SPECSERVE_SMALL_HEAD __m256 High256(__m512 x) {
  return _mm256_castpd_ps(
      _mm512_maskz_extractf64x4_pd(0x0f, _mm512_castps_pd(x), 1));
}

// Horizontal max and sum of 16 lanes, through 256- and 128-bit halves
// (GCC 12's _mm512_reduce_* warn as above).
SPECSERVE_SMALL_HEAD float ReduceMax16(__m512 x) {
  const __m256 a = _mm256_max_ps(Low256(x), High256(x));
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  b = _mm_max_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

SPECSERVE_SMALL_HEAD float ReduceAdd16(__m512 x) {
  const __m256 a = _mm256_add_ps(Low256(x), High256(x));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// The 8 lane sums of acc[0..7], in order: halves added, then three
// rounds of pairwise horizontal adds.
SPECSERVE_SMALL_HEAD __m256 LaneSums8(const __m512* acc) {
  __m256 a[8];
#pragma GCC unroll 16
  for (int d = 0; d < 8; ++d) {
    a[d] = _mm256_add_ps(Low256(acc[d]), High256(acc[d]));
  }
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23);  // 0-3 | 0-3, two halves
  const __m256 h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// exp(x) per lane for the attention weights, cheaper than kernels.cc's
// softmax exp (Cephes, bit-matched to its AVX2 twin): 2^t with
// t = x log2(e) split as n + f, |f| <= 1/2, 2^f by its degree-6 Taylor
// polynomial (relative error below 2e-7) and the scaling by 2^n in one
// vscalefps. Lanes below -87 (a masked key's -inf included) give 0.
SPECSERVE_SMALL_HEAD __m512 ExpForWeights(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f),
                                            _CMP_GT_OQ);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_maskz_roundscale_ps(  // masked form: see Transpose8
      0xffff, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// One query head's attention over the transposed chunks of its KV head:
// chunk c's 16 keys (values) of dimension d at kchunk[c] (vchunk[c]) +
// d * stride; the query (D floats, already scaled) sees keys
// [0, allowed) minus `masked` (tree attention). srow: chunks * 16 scratch
// floats for the scores; out: D floats. Two passes: scores and their max,
// then exp, sum and the weighted values together, normalised once.
template <int D>
SPECSERVE_SMALL_HEAD void AttendQuery(const float* qs,
                                      const float* const* kchunk,
                                      const float* const* vchunk, int stride,
                                      int allowed, const int* masked,
                                      int num_masked, float* srow,
                                      float* out) {
  const int chunks = (allowed + kChunk - 1) / kChunk;
  const int rem = allowed % kChunk;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 qv[D];
#pragma GCC unroll 16
  for (int d = 0; d < D; ++d) qv[d] = _mm512_set1_ps(qs[d]);
  __m512 mx = neg_inf;
  for (int c = 0; c < chunks; ++c) {
    const float* kc = kchunk[c];
    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kc));
  #pragma GCC unroll 16
    for (int d = 1; d < D; ++d) {
      s = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(kc + d * stride), s);
    }
    if (c == chunks - 1 && rem != 0) {  // later rows' keys and padding
      s = _mm512_mask_mov_ps(neg_inf, static_cast<__mmask16>((1u << rem) - 1),
                             s);
    }
    _mm512_storeu_ps(srow + c * kChunk, s);
    mx = _mm512_maskz_max_ps(0xffff, mx, s);
  }
  if (num_masked > 0) {
    for (int j = 0; j < num_masked; ++j) srow[masked[j]] = -INFINITY;
    mx = neg_inf;  // the row's own key is never masked: the max stays finite
    for (int c = 0; c < chunks; ++c) {
      mx = _mm512_maskz_max_ps(0xffff, mx, _mm512_loadu_ps(srow + c * kChunk));
    }
  }
  const __m512 m = _mm512_set1_ps(ReduceMax16(mx));
  __m512 acc[D];
#pragma GCC unroll 16
  for (int d = 0; d < D; ++d) acc[d] = _mm512_setzero_ps();
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < chunks; ++c) {
    const __m512 e =
        ExpForWeights(_mm512_sub_ps(_mm512_loadu_ps(srow + c * kChunk), m));
    sum = _mm512_add_ps(sum, e);
    const float* vc = vchunk[c];
  #pragma GCC unroll 16
    for (int d = 0; d < D; ++d) {
      acc[d] = _mm512_fmadd_ps(e, _mm512_loadu_ps(vc + d * stride), acc[d]);
    }
  }
  const __m256 inv = _mm256_set1_ps(1.f / ReduceAdd16(sum));
#pragma GCC unroll 16
  for (int d0 = 0; d0 < D; d0 += 8) {
    _mm256_storeu_ps(out + d0, _mm256_mul_ps(LaneSums8(acc + d0), inv));
  }
}

// Runs every query head of KV head g over its chunks (see AttendQuery).
template <int D>
SPECSERVE_SMALL_HEAD void AttendGroup(const float* q, size_t q_stride,
                                      int rows, int first, int g, int group,
                                      const float* const* kchunk,
                                      const float* const* vchunk, int stride,
                                      float scale, float* srow, float* qs,
                                      float* out, size_t out_stride,
                                      const int* mask_offsets,
                                      const int* mask_keys) {
  for (int i = 0; i < rows; ++i) {
    const int* masked = nullptr;
    int num_masked = 0;
    if (mask_offsets != nullptr) {
      masked = mask_keys + mask_offsets[i];
      num_masked = mask_offsets[i + 1] - mask_offsets[i];
    }
    for (int hh = 0; hh < group; ++hh) {
      const int head = g * group + hh;
      const float* src = q + i * q_stride + head * D;
      for (int d = 0; d < D; ++d) qs[d] = src[d] * scale;
      AttendQuery<D>(qs, kchunk, vchunk, stride, first + i + 1, masked,
                     num_masked, srow, out + i * out_stride + head * D);
    }
  }
}

// One call's scratch: with `planes`, one KV head's chunks of keys and
// values (kt, vt: [chunks][D][16]); one query's scores (srow, chunks * 16)
// and the scaled query (qs, D); the chunk pointers AttendQuery reads.
struct CallScratch {
  float* kt = nullptr;
  float* vt = nullptr;
  float* srow = nullptr;
  float* qs = nullptr;
  std::vector<const float*>* kchunk = nullptr;
  std::vector<const float*>* vchunk = nullptr;
};

CallScratch CarveScratch(std::vector<float>* scratch, int chunks, int D,
                         bool planes) {
  const size_t plane = planes ? static_cast<size_t>(chunks) * D * kChunk : 0;
  scratch->resize(2 * plane + static_cast<size_t>(chunks) * kChunk + D);
  thread_local std::vector<const float*> kchunk, vchunk;
  kchunk.resize(chunks);
  vchunk.resize(chunks);
  CallScratch cs;
  cs.kt = scratch->data();
  cs.vt = cs.kt + plane;
  cs.srow = cs.vt + plane;
  cs.qs = cs.srow + static_cast<size_t>(chunks) * kChunk;
  cs.kchunk = &kchunk;
  cs.vchunk = &vchunk;
  return cs;
}

// Row-major planes: each KV head's chunks transposed into the scratch.
template <int D>
SPECSERVE_SMALL_HEAD void Attend(const float* q, size_t q_stride, int rows,
                                 int first, int H, int KV, const float* k,
                                 const float* v, const int32_t* off,
                                 float scale, std::vector<float>* scratch,
                                 float* out, size_t out_stride,
                                 const int* mask_offsets,
                                 const int* mask_keys) {
  const int group = H / KV;
  const int chunks = (first + rows + kChunk - 1) / kChunk;
  const CallScratch cs = CarveScratch(scratch, chunks, D, /*planes=*/true);
  float *kt = cs.kt, *vt = cs.vt;
  std::vector<const float*>& kchunk = *cs.kchunk;
  std::vector<const float*>& vchunk = *cs.vchunk;
  for (int c = 0; c < chunks; ++c) {
    kchunk[c] = kt + c * D * kChunk;
    vchunk[c] = vt + c * D * kChunk;
  }
  for (int g = 0; g < KV; ++g) {
    // The KV head's keys and values, transposed once for all its queries.
    for (int c = 0; c < chunks; ++c) {
      for (int d0 = 0; d0 < D; d0 += 8) {
        Transpose8(k + g * D + d0, off + c * kChunk,
                   kt + (c * D + d0) * kChunk);
        Transpose8(v + g * D + d0, off + c * kChunk,
                   vt + (c * D + d0) * kChunk);
      }
    }
    AttendGroup<D>(q, q_stride, rows, first, g, group, kchunk.data(),
                   vchunk.data(), kChunk, scale, cs.srow, cs.qs, out,
                   out_stride, mask_offsets, mask_keys);
  }
}

// Chunk-major planes: the chunks are read in place.
template <int D>
SPECSERVE_SMALL_HEAD void AttendChunkMajor(
    const float* q, size_t q_stride, int rows, int first, int H, int KV,
    const float* k, const float* v, const int* block_table, int block_size,
    float scale, std::vector<float>* scratch, float* out, size_t out_stride,
    const int* mask_offsets, const int* mask_keys) {
  const int group = H / KV;
  const int chunks = (first + rows + kChunk - 1) / kChunk;
  // Read in place, the chunks of a KV head sit one block apart, so they
  // share few L1 sets: from kCopyQueries queries on, each is re-read often
  // enough to pay for a copy into contiguous scratch (64-byte lines).
  const bool copy = rows * group >= kCopyQueries;
  const CallScratch cs = CarveScratch(scratch, chunks, D, copy);
  float *kt = cs.kt, *vt = cs.vt;
  std::vector<const float*>& kchunk = *cs.kchunk;
  std::vector<const float*>& vchunk = *cs.vchunk;
  for (int g = 0; g < KV; ++g) {
    for (int c = 0; c < chunks; ++c) {
      const int key = c * kChunk;
      const size_t at = ChunkMajorKvOffset(
          static_cast<size_t>(block_table[key / block_size]) * block_size +
              key % block_size,
          g, 0, KV, D, block_size);
      if (!copy) {
        kchunk[c] = k + at;
        vchunk[c] = v + at;
        continue;
      }
      kchunk[c] = kt + c * D * kChunk;
      vchunk[c] = vt + c * D * kChunk;
#pragma GCC unroll 16
      for (int d = 0; d < D; ++d) {
        _mm512_storeu_ps(kt + (c * D + d) * kChunk,
                         _mm512_loadu_ps(k + at + d * block_size));
        _mm512_storeu_ps(vt + (c * D + d) * kChunk,
                         _mm512_loadu_ps(v + at + d * block_size));
      }
    }
    AttendGroup<D>(q, q_stride, rows, first, g, group, kchunk.data(),
                   vchunk.data(), copy ? kChunk : block_size, scale, cs.srow,
                   cs.qs, out, out_stride, mask_offsets, mask_keys);
  }
}

}  // namespace

bool HasSmallHeadAttention(int head_dim) {
  return (head_dim == 8 || head_dim == 16) && UseAvx512();
}

void AttentionRowsSmallHead(const float* q, size_t q_stride, int rows,
                            int first, int num_heads, int num_kv_heads,
                            int head_dim, const float* k, const float* v,
                            size_t kv_stride, const int* block_table,
                            int block_size, float scale,
                            std::vector<float>* scratch, float* out,
                            size_t out_stride, const int* mask_offsets,
                            const int* mask_keys) {
  // Each key's offset in the planes, padded to whole chunks with the last
  // key's (its values are finite; the padding's weights are 0).
  thread_local std::vector<int32_t> off;
  const int total = first + rows;
  const int padded = (total + kChunk - 1) / kChunk * kChunk;
  off.resize(padded);
  for (int j = 0, b = 0; j < total; ++b) {
    const int64_t base = int64_t{block_table[b]} * block_size;
    for (int o = 0; o < block_size && j < total; ++o) {
      off[j++] = static_cast<int32_t>((base + o) * int64_t(kv_stride));
    }
  }
  for (int j = total; j < padded; ++j) off[j] = off[total - 1];
  if (head_dim == 8) {
    Attend<8>(q, q_stride, rows, first, num_heads, num_kv_heads, k, v,
              off.data(), scale, scratch, out, out_stride, mask_offsets,
              mask_keys);
  } else {
    Attend<16>(q, q_stride, rows, first, num_heads, num_kv_heads, k, v,
               off.data(), scale, scratch, out, out_stride, mask_offsets,
               mask_keys);
  }
}

void AttentionRowsSmallHeadChunkMajor(
    const float* q, size_t q_stride, int rows, int first, int num_heads,
    int num_kv_heads, int head_dim, const float* k, const float* v,
    const int* block_table, int block_size, float scale,
    std::vector<float>* scratch, float* out, size_t out_stride,
    const int* mask_offsets, const int* mask_keys) {
  if (head_dim == 8) {
    AttendChunkMajor<8>(q, q_stride, rows, first, num_heads, num_kv_heads, k,
                        v, block_table, block_size, scale, scratch, out,
                        out_stride, mask_offsets, mask_keys);
  } else {
    AttendChunkMajor<16>(q, q_stride, rows, first, num_heads, num_kv_heads,
                         k, v, block_table, block_size, scale, scratch, out,
                         out_stride, mask_offsets, mask_keys);
  }
}

}  // namespace kernels
}  // namespace specserve
