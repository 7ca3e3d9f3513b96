#ifndef SPECSERVE_COMMON_CUDA_ATTENTION_LAYOUT_H_
#define SPECSERVE_COMMON_CUDA_ATTENTION_LAYOUT_H_

// Constants and the per-sequence record layout shared by the batched
// attention plan (attention_plan.h, host) and its kernel (attention.cu,
// nvcc). No includes: both compilers read it.

namespace specserve {
namespace cuda_kernels {

/// (row, query head) pairs of one kv head that one block scores; the
/// kernel's tile (attention.cu) must match.
inline constexpr int kBatchedAttentionQueryTile = 16;
/// At most this many key splits per sequence.
inline constexpr int kBatchedAttentionMaxSplits = 64;
/// Sequences are split (flash-decoding) only while the step's unsplit
/// blocks are fewer than this many per multiprocessor: below it the GPU
/// would idle.
inline constexpr int kBatchedAttentionSplitBelowBlocksPerSm = 2;
/// Once splitting, the keys are cut for about this many blocks per
/// multiprocessor: one wave at the kernel's occupancy (its launch bounds,
/// 4 blocks an SM). It was 2 until 2026-11-29, when on an H200 one decode
/// row at 32K tokens took ~0.75 ms a layer (~180 GB/s). This change came
/// with 4 loads in flight a thread (attention.cu), and the two together
/// took that row to 358 us; their shares were not measured apart. At 32K
/// one row reaches kBatchedAttentionMaxSplits either way (planning for 2x
/// or 4x the SMs then changed nothing); shorter contexts and small batches
/// get twice the splits.
inline constexpr int kBatchedAttentionSplitBlocksPerSm = 4;
/// A split covers at least this many keys: fewer do not pay for the merge.
inline constexpr int kBatchedAttentionMinSplitKeys = 64;

/// Per-sequence fields of BatchedAttentionPlan::seq_info, in this order.
enum BatchedSeqField {
  kSeqRowStart = 0,   ///< first row of the sequence in q / out
  kSeqRows,           ///< its new rows
  kSeqFirst,          ///< cached tokens before them
  kSeqTableStart,     ///< offset of its block table
  kSeqSplits,         ///< key splits (1: the kernel writes `out` directly)
  kSeqKeysPerSplit,   ///< keys of each split but the last
  kSeqPartialStart,   ///< first partial triple; -1 with one split
  kSeqInfoFields = 8  ///< ints per sequence (one unused)
};

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_ATTENTION_LAYOUT_H_
