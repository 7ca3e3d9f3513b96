#ifndef SPECSERVE_COMMON_ENGINE_SMALL_HEAD_ATTENTION_H_
#define SPECSERVE_COMMON_ENGINE_SMALL_HEAD_ATTENTION_H_

#include <cstddef>
#include <vector>

namespace specserve {
namespace kernels {

/// Whether AttentionRowsSmallHead runs on this CPU for `head_dim`: 8 or 16
/// with AVX-512 (and not disabled by SPECSERVE_DISABLE_AVX512).
bool HasSmallHeadAttention(int head_dim);

/// Causal grouped-query attention (GQA) of `rows` new rows straight from
/// the paged f32 cache, for the small heads (8 or 16 dims) of the bundled
/// test-size models, where kernels::AttentionRows reduces each 8-dim dot
/// product across lanes and the GEMM path copies the whole context and
/// pays two library calls per KV head. Per KV head, the keys and values
/// are transposed once into 16-token chunks (one vector per dimension, by
/// in-register 8 x 8 transposes), shared by all the head's queries; a
/// query's 16 scores are then head_dim FMAs, and a second pass does the
/// exponentials, their sum and the weighted values together (softmax
/// normalised once per query, FlashAttention-style).
///
/// Same contract as kernels::AttentionRows over an f32 cache: q [rows]
/// rows of num_heads * head_dim (stride q_stride) at cache slots first ..
/// first + rows - 1; k, v paged planes of num_kv_heads * head_dim floats
/// per token (row stride kv_stride, PagedAttention's block tables); row i
/// attends to slots [0, first + i] minus mask_keys[mask_offsets[i] ..
/// mask_offsets[i + 1]) when mask_offsets is set (tree attention). out:
/// [rows] rows of num_heads * head_dim (stride out_stride). scratch grows
/// to (2 * head_dim + 1) * P + head_dim floats, P = first + rows rounded
/// up to 16 (transposed keys and values, one query's scores, the scaled
/// query).
/// Requires HasSmallHeadAttention(head_dim) and the cache's
/// (slot * kv_stride) offsets below 2^31 floats; results agree with
/// AttentionRows to float rounding (the sums are associated differently).
void AttentionRowsSmallHead(const float* q, size_t q_stride, int rows,
                            int first, int num_heads, int num_kv_heads,
                            int head_dim, const float* k, const float* v,
                            size_t kv_stride, const int* block_table,
                            int block_size, float scale,
                            std::vector<float>* scratch, float* out,
                            size_t out_stride,
                            const int* mask_offsets = nullptr,
                            const int* mask_keys = nullptr);

/// The chunk-major layout of an f32 K (or V) plane for small heads: the
/// element (cache slot `slot`, KV head g, dimension d) at this offset, i.e.
/// per block [num_kv_heads][head_dim][block_size]. With block_size a
/// multiple of 16, 16 consecutive keys of one dimension are one vector, so
/// AttentionRowsSmallHeadChunkMajor needs no transposes (a block occupies
/// the same floats as in the row-major layout, so block copies do not
/// change).
inline size_t ChunkMajorKvOffset(size_t slot, int g, int d, int num_kv_heads,
                                 int head_dim, int block_size) {
  const size_t block = slot / block_size;
  return ((block * num_kv_heads + g) * head_dim + d) * block_size +
         slot % block_size;
}

/// Whether an f32 cache of `head_dim`-dim heads in blocks of `block_size`
/// tokens can be kept chunk-major on this CPU: HasSmallHeadAttention and
/// block_size a multiple of 16.
inline bool UsesChunkMajorKv(int head_dim, int block_size) {
  return HasSmallHeadAttention(head_dim) && block_size % 16 == 0;
}

/// AttentionRowsSmallHead over chunk-major planes k, v (see
/// ChunkMajorKvOffset; requires UsesChunkMajorKv(head_dim, block_size)):
/// the same arguments less kv_stride, the same results bit for bit.
/// scratch grows to P + head_dim floats (P as above).
void AttentionRowsSmallHeadChunkMajor(
    const float* q, size_t q_stride, int rows, int first, int num_heads,
    int num_kv_heads, int head_dim, const float* k, const float* v,
    const int* block_table, int block_size, float scale,
    std::vector<float>* scratch, float* out, size_t out_stride,
    const int* mask_offsets = nullptr, const int* mask_keys = nullptr);

}  // namespace kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_SMALL_HEAD_ATTENTION_H_
