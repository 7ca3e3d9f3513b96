#ifndef SPECSERVE_COMMON_CUDA_ATTENTION_PLAN_H_
#define SPECSERVE_COMMON_CUDA_ATTENTION_PLAN_H_

// Host-side work partitioning of the batched attention launch
// (cuda_kernels::BatchedAttention): which (sequence, query tile, key split)
// each thread block of the one launch per layer handles, how many key
// splits each sequence gets (flash-decoding: long contexts are split so
// that a small batch still fills the GPU), and where the split partials go.
// Plain C++ (no CUDA headers): tested on the CPU.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cuda/attention_layout.h"

namespace specserve {
namespace cuda_kernels {

/// One sequence of a step: `rows` new tokens (decode: 1, verify: k + 1,
/// prefill chunk: any), already in the cache after `first` earlier tokens,
/// so row i attends to cache slots [0, first + i]. `table_start`: offset of
/// the sequence's block table in the concatenated tables the kernel reads.
/// `row_start`: its first row in q / out; -1 (default) puts it right after
/// the previous sequence's rows (0 for the first), an explicit value lets
/// rows of sequences attended elsewhere (FlashAttention) be skipped.
struct AttentionSequence {
  int rows = 0;
  int first = 0;
  int table_start = 0;
  int row_start = -1;
};

/// The launch plan, uploaded as int arrays. Partial triple (s, r, h) of a
/// split sequence is at index partial_start + (s * rows + r) * H + h.
struct BatchedAttentionPlan {
  int num_seqs = 0;
  int total_rows = 0;
  /// int [num_seqs * kSeqInfoFields], see BatchedSeqField.
  std::vector<int> seq_info;
  /// int [3 * num_work]: (sequence, query tile, split) of block x; every
  /// block of the launch also spans the kv heads (grid y).
  std::vector<int> work;
  /// int [2 * num_combine]: (global row, sequence) of each row of a split
  /// sequence, merged by the combine kernel (grid x; y = query heads).
  std::vector<int> combine;
  /// Total partial (split, row, head) triples; the workspace holds
  /// partial_triples * (head_dim + 2) floats.
  int64_t partial_triples = 0;

  int num_work() const { return static_cast<int>(work.size() / 3); }
  int num_combine() const { return static_cast<int>(combine.size() / 2); }
};

/// Plans one launch over `seqs` (rows concatenated in order) for grouped-
/// query attention with `num_heads` query and `num_kv_heads` kv heads on a
/// GPU with `num_sms` multiprocessors. Splits: none while the blocks
/// without splits (query tiles x kv heads) already number
/// kBatchedAttentionSplitBelowBlocksPerSm per SM; otherwise the total key
/// work (tiles x keys) is cut into chunks of equal size (>=
/// kBatchedAttentionMinSplitKeys keys, a multiple of 32) so that about
/// kBatchedAttentionSplitBlocksPerSm * num_sms blocks run, and each sequence gets ceil(keys / chunk)
/// splits (at most kBatchedAttentionMaxSplits): long contexts get more,
/// short ones stay whole. Sequences with 0 rows get no blocks.
/// total_rows: the end of the last rows (max of row_start + rows).
/// InvalidArgument for a negative rows / first / table_start, row_start
/// below -1, an int overflow of the rows or partials, num_heads or
/// num_kv_heads < 1, or num_heads not a multiple of num_kv_heads.
absl::StatusOr<BatchedAttentionPlan> PlanBatchedAttention(
    const std::vector<AttentionSequence>& seqs, int num_heads, int num_kv_heads,
    int num_sms);

/// Device scratch bytes of `plan`'s split partials: fp32 outputs
/// [triples, head_dim] then maxima and sums [triples] each.
size_t BatchedAttentionWorkspaceBytes(const BatchedAttentionPlan& plan,
                                      int head_dim);

/// Upper bounds of any plan PlanBatchedAttention makes for at most
/// `max_seqs` sequences of at least one row and `max_rows` rows in all, at
/// any context length: a CUDA graph launches that many blocks and the ones
/// past the step's real counts return at once. Without splits the work is
/// the query tiles, sum ceil(rows * group / 16) <= (rows * group + 15 *
/// seqs) / 16; with splits the chunk rule keeps tiles x splits x kv heads
/// below (kBatchedAttentionSplitBlocksPerSm +
/// kBatchedAttentionSplitBelowBlocksPerSm) * num_sms, and a split
/// sequence's rows are at most 16 / group per tile.
struct BatchedAttentionCapacity {
  int num_work = 0;
  int num_combine = 0;
  int64_t partial_triples = 0;
};
BatchedAttentionCapacity BatchedAttentionCapacityFor(int max_rows,
                                                     int max_seqs,
                                                     int num_heads,
                                                     int num_kv_heads,
                                                     int num_sms);

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_ATTENTION_PLAN_H_
