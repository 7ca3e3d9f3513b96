#ifndef SPECSERVE_COMMON_ENGINE_KERNELS_H_
#define SPECSERVE_COMMON_ENGINE_KERNELS_H_

// Element-wise and row-wise fp32 kernels of the CPU Llama forward (AVX2/FMA,
// the x86-64-v3 baseline; PanelGemm dispatches to AVX-512 at run time).
// Prefill-sized GEMMs go through OpenBLAS; these are the rest.

#include <cstddef>
#include <cstdint>

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

/// As above with given frequencies: dimension i rotates by
/// pos * inv_freq[i] (inv_freq: [head_dim / 2], e.g. from
/// ComputeRopeFrequencies), and cos / sin are multiplied by
/// `attention_factor` (YaRN's mscale; 1 leaves the norms unchanged).
void ApplyRope(float* x, size_t row_stride, int rows, int num_heads,
               int head_dim, const int* positions, const double* inv_freq,
               double attention_factor);

/// Adds `bias` [cols] to each of `rows` rows of `x` (row stride `stride`).
void AddBias(float* x, size_t stride, int rows, int cols, const float* bias);

/// SwiGLU: out[r, i] = silu(gu[r, i]) * gu[r, ffn + i] for gu [rows, 2*ffn]
/// (gate columns then up columns); out [rows, ffn].
void SiluMul(const float* gu, int rows, int ffn, float* out);

/// In-place softmax of `row[0, n)`; entries [n, total) are set to 0.
/// Returns nothing; uses a vectorised exp with ~1e-7 relative error that
/// is exactly 0 below -88.37 (so -inf scores get weight 0). At least one
/// entry must be finite.
void SoftmaxPrefix(float* row, int n, int total);

/// y[i] = exp(x[i]) for n floats (vectorised; relative error ~1e-7).
void ExpInPlace(float* x, int n);

/// Maximum of x[0, n); n >= 1.
float MaxOf(const float* x, int n);

/// Whether PanelGemm takes its AVX-512 path: the CPU has AVX-512F and the
/// environment variable SPECSERVE_DISABLE_AVX512 is unset.
bool UseAvx512();

/// Output columns per packed panel.
inline constexpr int kPanelWidth = 32;
/// Floats PackPanels writes for a [out, in] matrix: ceil(out / 32) * 32 *
/// in (the last panel zero-padded).
inline size_t PackedPanelFloats(int out, int in) {
  return static_cast<size_t>((out + kPanelWidth - 1) / kPanelWidth) *
         kPanelWidth * in;
}
/// Repacks a PyTorch Linear weight w [out, in] into panels of 32 output
/// columns, [ceil(out / 32)][in][32]: the layout PanelGemm streams
/// sequentially (the packing GEMM libraries do per call, done once at
/// load).
void PackPanels(const float* w, int out, int in, float* packed);
/// y[i, o] = dot(x[i, :], w[o, :]) + beta * y[i, o] for the n rows of x
/// [n, in] and the outputs of panels [panel_begin, panel_end) of `packed`
/// (PackPanels of w [out, in]); y [n, y_stride]. Outer-product form: per
/// k, a panel's 32 weights times each row's x[k] broadcast, 8 rows at a
/// time on AVX-512 (16 zmm accumulators). The panel is walked in 128-k
/// blocks that every row group passes over while the block is in L1, so
/// each weight is read from memory once per call for all n rows, and the
/// next block is prefetched at the pace of the arithmetic. For decode /
/// verify batches of a few to 64 rows. Row i's result does not depend on
/// the other rows (bit for bit).
void PanelGemm(const float* x, int n, int in, const float* packed,
               int panel_begin, int panel_end, float* y, int y_stride, int out,
               float beta);
/// The AVX2 implementation of PanelGemm (tests compare both paths).
void PanelGemmAvx2(const float* x, int n, int in, const float* packed,
                   int panel_begin, int panel_end, float* y, int y_stride,
                   int out, float beta);

/// Causal grouped-query attention (Vaswani et al. 2017; GQA, Ainslie et al.
/// 2023) of a few new rows, without GEMM calls: decode and verify rows,
/// where a GEMM library's per-call cost exceeds the arithmetic.
/// q: [rows] rows of num_heads * head_dim (row stride q_stride) at cache
/// slots first .. first + rows - 1; k, v: paged key / value planes whose
/// rows hold num_kv_heads * head_dim floats (row stride kv_stride), logical
/// slot j at physical row block_table[j / block_size] * block_size +
/// j % block_size (PagedAttention's layout). Row i attends to slots
/// [0, first + i] with softmax(q.k * scale). The cache is read key-major
/// (8 tokens at a time, all heads), so it streams sequentially. scores:
/// scratch of num_heads * (first + rows) floats. out: [rows] rows of
/// num_heads * head_dim (stride out_stride). num_heads must be a multiple
/// of num_kv_heads. Tree attention: with mask_offsets non-null, row i
/// also does not see the slots mask_keys[mask_offsets[i] ..
/// mask_offsets[i + 1]) (TreeMask's compressed rows).
void AttentionRows(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const float* k, const float* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride,
                   const int* mask_offsets = nullptr,
                   const int* mask_keys = nullptr);

/// As above over a bf16 cache (each element the top 16 bits of an f32, as
/// FloatToBf16Row stores it): rows are widened to f32 8 elements at a time
/// (AVX2) and the arithmetic is the f32 one, so the result equals the f32
/// overload's on the bf16 values widened, bit for bit.
void AttentionRows(const float* q, size_t q_stride, int rows, int first,
                   int num_heads, int num_kv_heads, int head_dim,
                   const uint16_t* k, const uint16_t* v, size_t kv_stride,
                   const int* block_table, int block_size, float scale,
                   float* scores, float* out, size_t out_stride,
                   const int* mask_offsets = nullptr,
                   const int* mask_keys = nullptr);

/// out[i] = x[i] as bfloat16 bits (the top half of the f32), rounded to
/// nearest even; NaN stays (quiet) NaN, as FloatToBFloat16. n floats.
void FloatToBf16Row(const float* x, size_t n, uint16_t* out);

/// out[i] = the f32 whose top half is x[i] (exact). n elements.
void Bf16ToFloatRow(const uint16_t* x, size_t n, float* out);

/// Hides keys from a row of attention scores before its softmax:
/// row[keys[0..count)] = -inf, which SoftmaxPrefix turns into exactly 0
/// (the same as a softmax that never saw those keys).
void MaskScores(float* row, const int* keys, int count);

}  // namespace kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_KERNELS_H_
