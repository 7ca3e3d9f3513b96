#include "common/engine/small_head_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common/engine/kernels.h"

namespace specserve {
namespace kernels {
namespace {

#define SPECSERVE_SMALL_HEAD __attribute__((target("avx512f")))

constexpr int kChunk = 16;  // keys per step: one AVX-512 vector of scores

// scores[m * stride + j] = qs_m . key_j for the group's M query vectors
// (already scaled) and the keys of one chunk: D gathers build the chunk's
// keys one dimension per vector, then each query is D FMAs.
template <int D>
SPECSERVE_SMALL_HEAD void ChunkScores(const float* kbase, const int32_t* off,
                                      const float* qs, int M, float* scores,
                                      size_t stride) {
  const __m512i idx = _mm512_loadu_si512(off);
  __m512 kt[D];
  // The masked forms with a defined source: GCC 12's unmasked intrinsics
  // start from an "undefined" vector and warn (-Wuninitialized).
  for (int d = 0; d < D; ++d) {
    kt[d] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, idx,
                                     kbase + d, 4);
  }
  for (int m = 0; m < M; ++m) {
    const float* qm = qs + m * D;
    __m512 s = _mm512_mul_ps(_mm512_set1_ps(qm[0]), kt[0]);
    for (int d = 1; d < D; ++d) {
      s = _mm512_fmadd_ps(_mm512_set1_ps(qm[d]), kt[d], s);
    }
    _mm512_storeu_ps(scores + m * stride, s);
  }
}

// acc_m += sum_j p[m][j] * value_j over one chunk; 8-dim values two
// tokens per vector (acc lanes 0-7 even tokens, 8-15 odd ones).
SPECSERVE_SMALL_HEAD void ChunkValues8(const float* vbase, const int32_t* off,
                                       const float* p, size_t stride, int M,
                                       float* acc) {
  __m512 vp[kChunk / 2];
  for (int j = 0; j < kChunk / 2; ++j) {
    const __m256 lo = _mm256_loadu_ps(vbase + off[2 * j]);
    const __m256 hi = _mm256_loadu_ps(vbase + off[2 * j + 1]);
    // lo in the low half, hi broadcast into the high one (AVX512F only).
    vp[j] = _mm512_castpd_ps(_mm512_mask_broadcast_f64x4(
        _mm512_maskz_broadcast_f64x4(0x0f, _mm256_castps_pd(lo)), 0xf0,
        _mm256_castps_pd(hi)));
  }
  // Lane l of pick[j]: token 2j for l < 8, token 2j + 1 above.
  __m512i pick[kChunk / 2];
  for (int j = 0; j < kChunk / 2; ++j) {
    pick[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * j), 0xff00,
                                     2 * j + 1);
  }
  for (int m = 0; m < M; ++m) {
    const __m512 pm = _mm512_loadu_ps(p + m * stride);
    __m512 a = _mm512_loadu_ps(acc + m * kChunk);
    for (int j = 0; j < kChunk / 2; ++j) {
      a = _mm512_fmadd_ps(_mm512_mask_permutexvar_ps(pm, 0xffff, pick[j], pm),
                          vp[j], a);
    }
    _mm512_storeu_ps(acc + m * kChunk, a);
  }
}

// The same for 16-dim values: one token per vector.
SPECSERVE_SMALL_HEAD void ChunkValues16(const float* vbase, const int32_t* off,
                                        const float* p, size_t stride, int M,
                                        float* acc) {
  __m512 vt[kChunk];
  for (int t = 0; t < kChunk; ++t) vt[t] = _mm512_loadu_ps(vbase + off[t]);
  for (int m = 0; m < M; ++m) {
    const float* pm = p + m * stride;
    __m512 a = _mm512_loadu_ps(acc + m * kChunk);
    for (int t = 0; t < kChunk; ++t) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(pm[t]), vt[t], a);
    }
    _mm512_storeu_ps(acc + m * kChunk, a);
  }
}

template <int D>
SPECSERVE_SMALL_HEAD void Attend(const float* q, size_t q_stride, int rows,
                                 int first, int H, int KV, const float* k,
                                 const float* v, const int32_t* off,
                                 float scale, std::vector<float>* scratch,
                                 float* out, size_t out_stride,
                                 const int* mask_offsets,
                                 const int* mask_keys) {
  const int group = H / KV;
  const int M = rows * group;  // query vectors per KV head
  const int total = first + rows;
  const int chunks = (total + kChunk - 1) / kChunk;
  const size_t stride = static_cast<size_t>(chunks) * kChunk;
  scratch->resize(M * stride + static_cast<size_t>(M) * (kChunk + D));
  float* scores = scratch->data();
  float* acc = scores + M * stride;
  float* qs = acc + static_cast<size_t>(M) * kChunk;
  for (int g = 0; g < KV; ++g) {
    for (int i = 0; i < rows; ++i) {
      for (int hh = 0; hh < group; ++hh) {
        const float* src = q + i * q_stride + (g * group + hh) * D;
        float* dst = qs + (i * group + hh) * D;
        for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
      }
    }
    const float* kg = k + g * D;
    const float* vg = v + g * D;
    for (int c = 0; c < chunks; ++c) {
      ChunkScores<D>(kg, off + c * kChunk, qs, M, scores + c * kChunk, stride);
    }
    for (int i = 0; i < rows; ++i) {
      const int allowed = first + i + 1;  // causal over cache order
      for (int hh = 0; hh < group; ++hh) {
        float* row = scores + (i * group + hh) * stride;
        if (mask_offsets != nullptr && mask_offsets[i + 1] > mask_offsets[i]) {
          MaskScores(row, mask_keys + mask_offsets[i],
                     mask_offsets[i + 1] - mask_offsets[i]);
        }
        // Zeroes [allowed, stride): later rows' keys and the padding.
        SoftmaxPrefix(row, allowed, static_cast<int>(stride));
      }
    }
    std::fill(acc, acc + static_cast<size_t>(M) * kChunk, 0.f);
    for (int c = 0; c < chunks; ++c) {
      if (D == 8) {
        ChunkValues8(vg, off + c * kChunk, scores + c * kChunk, stride, M, acc);
      } else {
        ChunkValues16(vg, off + c * kChunk, scores + c * kChunk, stride, M,
                      acc);
      }
    }
    for (int i = 0; i < rows; ++i) {
      for (int hh = 0; hh < group; ++hh) {
        const float* a = acc + (i * group + hh) * kChunk;
        float* o = out + i * out_stride + (g * group + hh) * D;
        if (D == 8) {
          _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(a),
                                            _mm256_loadu_ps(a + 8)));
        } else {
          _mm512_storeu_ps(o, _mm512_loadu_ps(a));
        }
      }
    }
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

}  // namespace kernels
}  // namespace specserve
