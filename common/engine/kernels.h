#ifndef SPECSERVE_COMMON_ENGINE_KERNELS_H_
#define SPECSERVE_COMMON_ENGINE_KERNELS_H_

// Element-wise and row-wise fp32 kernels of the CPU Llama forward (AVX2/FMA,
// the x86-64-v3 baseline). GEMMs go through OpenBLAS; these are the rest.

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
void BatchedGemv(const float* x, int n, int in, const float* w, int o_begin,
                 int o_end, float* y, int y_stride, float beta);

}  // namespace kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_KERNELS_H_
