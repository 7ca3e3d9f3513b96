#include "common/cuda/attention_plan.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace specserve {
namespace cuda_kernels {

absl::StatusOr<BatchedAttentionPlan> PlanBatchedAttention(
    const std::vector<AttentionSequence>& seqs, int num_heads, int num_kv_heads,
    int num_sms) {
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batched attention: ", num_heads, " query heads over ",
                     num_kv_heads, " kv heads"));
  }
  const int group = num_heads / num_kv_heads;
  const int S = static_cast<int>(seqs.size());
  std::vector<int64_t> tiles(S), keys(S);
  int64_t base_blocks = 0, key_work = 0, rows = 0, prev_end = 0;
  for (int i = 0; i < S; ++i) {
    const AttentionSequence& s = seqs[i];
    if (s.rows < 0 || s.first < 0 || s.table_start < 0 || s.row_start < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("batched attention: sequence ", i, " has rows ", s.rows,
                       ", first ", s.first, ", table_start ", s.table_start,
                       ", row_start ", s.row_start));
    }
    tiles[i] = (int64_t{s.rows} * group + kBatchedAttentionQueryTile - 1) /
               kBatchedAttentionQueryTile;
    keys[i] = int64_t{s.first} + s.rows;
    base_blocks += tiles[i] * num_kv_heads;
    key_work += tiles[i] * num_kv_heads * keys[i];
    prev_end = (s.row_start >= 0 ? s.row_start : prev_end) + s.rows;
    rows = std::max(rows, prev_end);
  }
  if (rows > INT32_MAX / std::max(num_heads, 1)) {
    return absl::InvalidArgumentError("batched attention: too many rows");
  }
  const int64_t sms = std::max(num_sms, 1);
  const int64_t want = kBatchedAttentionSplitBlocksPerSm * sms;
  // Keys per split: the whole context unless the GPU would idle.
  int64_t chunk = INT64_MAX;
  if (base_blocks > 0 &&
      base_blocks < kBatchedAttentionSplitBelowBlocksPerSm * sms) {
    chunk = std::max<int64_t>((key_work + want - 1) / want,
                              kBatchedAttentionMinSplitKeys);
    chunk = (chunk + 31) / 32 * 32;
  }

  BatchedAttentionPlan plan;
  plan.num_seqs = S;
  plan.total_rows = static_cast<int>(rows);
  plan.seq_info.assign(static_cast<size_t>(S) * kSeqInfoFields, 0);
  int row_start = 0;
  for (int i = 0; i < S; ++i) {
    const AttentionSequence& s = seqs[i];
    if (s.row_start >= 0) row_start = s.row_start;
    int splits = 1;
    if (chunk != INT64_MAX && s.rows > 0) {
      splits = static_cast<int>(std::clamp<int64_t>(
          (keys[i] + chunk - 1) / chunk, 1, kBatchedAttentionMaxSplits));
    }
    const int64_t per_split =
        std::max<int64_t>(1, (keys[i] + splits - 1) / splits);
    int* info = plan.seq_info.data() + static_cast<size_t>(i) * kSeqInfoFields;
    info[kSeqRowStart] = row_start;
    info[kSeqRows] = s.rows;
    info[kSeqFirst] = s.first;
    info[kSeqTableStart] = s.table_start;
    info[kSeqSplits] = splits;
    info[kSeqKeysPerSplit] = static_cast<int>(per_split);
    info[kSeqPartialStart] = -1;
    if (splits > 1) {
      info[kSeqPartialStart] = static_cast<int>(plan.partial_triples);
      plan.partial_triples += int64_t{splits} * s.rows * num_heads;
      if (plan.partial_triples > INT32_MAX) {
        return absl::InvalidArgumentError(
            "batched attention: split partials exceed 2^31");
      }
      for (int r = 0; r < s.rows; ++r) {
        plan.combine.push_back(row_start + r);
        plan.combine.push_back(i);
      }
    }
    for (int t = 0; t < tiles[i]; ++t) {
      for (int sp = 0; sp < splits; ++sp) {
        plan.work.push_back(i);
        plan.work.push_back(t);
        plan.work.push_back(sp);
      }
    }
    row_start += s.rows;
  }
  return plan;
}

size_t BatchedAttentionWorkspaceBytes(const BatchedAttentionPlan& plan,
                                      int head_dim) {
  return sizeof(float) * static_cast<size_t>(plan.partial_triples) *
         (static_cast<size_t>(std::max(head_dim, 0)) + 2);
}

BatchedAttentionCapacity BatchedAttentionCapacityFor(int max_rows,
                                                     int max_seqs,
                                                     int num_heads,
                                                     int num_kv_heads,
                                                     int num_sms) {
  BatchedAttentionCapacity cap;
  if (max_rows < 1 || max_seqs < 1 || num_heads < 1 || num_kv_heads < 1 ||
      num_heads % num_kv_heads != 0) {
    return cap;
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t seqs = std::min(max_seqs, max_rows);
  const int64_t tiles =
      (int64_t{max_rows} * group + (kBatchedAttentionQueryTile - 1) * seqs) /
      kBatchedAttentionQueryTile;
  // Split blocks: sum tiles x ceil(keys / chunk) x kv heads <= key work /
  // chunk + unsplit blocks < want + the split threshold (PlanBatched-
  // Attention's chunk is at least key work / want).
  const int64_t split_work =
      ((kBatchedAttentionSplitBlocksPerSm +
        kBatchedAttentionSplitBelowBlocksPerSm) *
           int64_t{std::max(num_sms, 1)} +
       num_kv_heads - 1) /
      num_kv_heads;
  cap.num_work = static_cast<int>(std::max(tiles, split_work));
  cap.num_combine = max_rows;
  cap.partial_triples =
      num_heads *
      std::min<int64_t>(int64_t{kBatchedAttentionMaxSplits} * max_rows,
                        (kBatchedAttentionQueryTile * split_work + group - 1) /
                            group);
  return cap;
}

}  // namespace cuda_kernels
}  // namespace specserve
