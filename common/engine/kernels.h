#ifndef SPECSERVE_COMMON_ENGINE_KERNELS_H_
#define SPECSERVE_COMMON_ENGINE_KERNELS_H_

// Element-wise and row-wise fp32 kernels of the CPU Llama forward (AVX2/FMA,
// the x86-64-v3 baseline; BatchedGemv dispatches to AVX-512 at run time).
// Prefill-sized GEMMs go through OpenBLAS; these are the rest.

#include <cstddef>

namespace specserve {
namespace kernels {

/// RMSNorm (Zhang & Sennrich 2019, as HF LlamaRMSNorm): for each of `rows`
/// rows of `dim` floats, out = x * w / sqrt(mean(x^2) + eps). `x` and `out`
/// are [rows, dim] with row strides `x_stride` / `out_stride`; may alias.
void RmsNorm(const float* x, size_t x_stride, const float* w, float eps,
             int rows, int dim, float* out, size_t out_stride);

/// Rotary embedding, HF rotate_half layout: within each head, dimension i
/// pairs with i + head_dim/2 and rotates by angle pos * theta^(-2i/head_dim)
/// (angles in double). `x` is [rows, row_stride]; each row holds `num_heads`
/// heads of `head_dim` starting at the row start. `positions`: [rows].
void ApplyRope(float* x, size_t row_stride, int rows, int num_heads,
               int head_dim, const int* positions, double theta);

/// SwiGLU: out[r, i] = silu(gu[r, i]) * gu[r, ffn + i] for gu [rows, 2*ffn]
/// (gate columns then up columns); out [rows, ffn].
void SiluMul(const float* gu, int rows, int ffn, float* out);

/// In-place softmax of `row[0, n)`; entries [n, total) are set to 0.
/// Returns nothing; uses a vectorised exp with ~1e-7 relative error.
void SoftmaxPrefix(float* row, int n, int total);

/// y[i] = exp(x[i]) for n floats (vectorised; relative error ~1e-7).
void ExpInPlace(float* x, int n);

/// Maximum of x[0, n); n >= 1.
float MaxOf(const float* x, int n);

/// y[i, o] = dot(x[i, :], w[o, :]) + beta * y[i, o] for a few rows:
/// x [n, in], w [out, in] (PyTorch Linear layout), y [n, out]. Streams the
/// weights once for all n rows (a batched GEMV), which is what decode and
/// small verify rounds need: OpenBLAS's sgemm packs the whole weight matrix
/// for a handful of rows and costs ~2.5x a GEMV there. Output rows
/// [o_begin, o_end) only, so callers can split the work across threads.
/// Uses AVX-512 when the CPU has it (run-time dispatch; 16-lane FMAs and 32
/// registers for 4x4 register tiles), else AVX2. Any n works: rows go in
/// tiles of 4 (3 on AVX2) against L2-sized blocks of weight rows, so the
/// weights come from memory once and from L2 for the remaining tiles.
void BatchedGemv(const float* x, int n, int in, const float* w, int o_begin,
                 int o_end, float* y, int y_stride, float beta);

/// The AVX2 implementation of BatchedGemv (tests compare both paths).
void BatchedGemvAvx2(const float* x, int n, int in, const float* w,
                     int o_begin, int o_end, float* y, int y_stride,
                     float beta);

/// Whether BatchedGemv takes its AVX-512 path: the CPU has AVX-512F and
/// the environment variable SPECSERVE_DISABLE_AVX512 is unset.
bool UseAvx512();

/// Causal grouped-query attention (Vaswani et al. 2017; GQA, Ainslie et al.
/// 2023) of a few new rows, without GEMM calls: decode and verify rows,
/// where a GEMM library's per-call cost exceeds the arithmetic.
/// q: [rows] rows of num_heads * head_dim (row stride q_stride) at cache
/// slots first .. first + rows - 1; k, v: paged key / value planes whose
/// rows hold num_kv_heads * head_dim floats (row stride kv_stride), logical
/// slot j at physical row block_table[j / block_size] * block_size +
/// j % block_size (PagedAttention's layout). Row i attends to slots
/// [0, first + i] with softmax(q.k * scale). scores: scratch of
/// first + rows floats. out: [rows] rows of num_heads * head_dim (stride
/// out_stride). num_heads must be a multiple of num_kv_heads.
void AttentionRows(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const float* k, const float* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride);

}  // namespace kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_KERNELS_H_
