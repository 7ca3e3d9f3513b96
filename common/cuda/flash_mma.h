#ifndef SPECSERVE_COMMON_CUDA_FLASH_MMA_H_
#define SPECSERVE_COMMON_CUDA_FLASH_MMA_H_

// Prefill attention on the tensor cores through PTX mma.sync / ldmatrix /
// cp.async (flash_mma.cu), FlashAttention-2 style (Dao 2023, "Faster
// Attention with Better Parallelism and Work Partitioning"): the scores and
// probabilities of a key tile never leave the mma accumulator registers.
// Same semantics as cuda_kernels::FlashAttention (kernels.h); plain C++ so
// host code compiled by g++ can call it.

#include <cuda_runtime_api.h>

#include "common/cuda/kernels.h"

namespace specserve {
namespace cuda_kernels {

/// Whether FlashMmaAttention handles `head_dim` and `dtype`: head_dim 64 or
/// 128, dtype kBF16 or kFP16. Host-only, no CUDA call.
bool FlashMmaSupported(int head_dim, CudaDType dtype);

/// Causal grouped-query prefill attention of `args.n` new rows of one
/// sequence over the (paged) KV cache, as FlashAttention computes it (see
/// AttentionArgs): row i (cache slot first + i) attends to slots
/// [0, first + i]; query head h reads kv head h / (H / KV); softmax of
/// scale * q.k in fp32; out[i, h * D : (h + 1) * D] = sum_j p_ij v_j stored
/// as T.
///
/// Shapes: q T [n, H, D]; k_cache / v_cache T [pool rows, KV, D] with slot t
/// at row block_table[t / block_size] * block_size + t % block_size (row t
/// when block_table is null); out T [n, H * D]. T = `args.dtype`.
///
/// Kernel: one block of 4 warps per (head, 64 query rows); each warp owns 16
/// rows. Key tiles of 64 are double-buffered in shared memory by cp.async;
/// S = Q K^T and O += P V run on mma.sync.m16n8k16 (bf16 / fp16 operands,
/// fp32 accumulation) fed by ldmatrix (.trans for V); the online softmax
/// works on the accumulator fragments in registers and P is rounded to T as
/// the A operand of P V. Key tiles wholly above the causal diagonal are not
/// loaded. Lengths need not be tile multiples.
///
/// Errors: cudaErrorInvalidValue, before any CUDA call, unless
/// FlashMmaSupported(head_dim, dtype); for tree masks (tree_start or
/// tree_mask non-null: prefill chunks carry none); n < 0, first < 0,
/// num_kv_heads < 1 or num_heads not a positive multiple of it, first + n
/// past INT_MAX or n past 64 * 65535 rows; block_size < 1 with a block
/// table; and, for n > 0, a null q / k_cache / v_cache / out or one not
/// 16-byte aligned (the kernel moves 16-byte vectors). n == 0 enqueues
/// nothing and returns cudaSuccess. Otherwise the launch error, if any.
cudaError_t FlashMmaAttention(const AttentionArgs& args, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_FLASH_MMA_H_
