#ifndef SPECSERVE_COMMON_CUDA_STEP_INPUTS_H_
#define SPECSERVE_COMMON_CUDA_STEP_INPUTS_H_

// The host side of two device paths of CudaModelRunner, as plain C++ so the
// CPU tests cover them: the packed inputs of SampleRows (sampled rows) and
// the padded inputs of a step replayed from a CUDA graph.

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/cuda/attention_plan.h"
#include "common/engine/model_runner.h"

namespace specserve {
namespace cuda_step {

/// SampleRows jobs (sampling_kernels.h): with J = num_rows jobs,
///   ints   = [J] logit rows (global, into the step's logits), [J] top-k,
///            [J] draft ids, [J + 1] q offsets, then the q ids of every
///            draft distribution
///   floats = [J] temperatures, [J] top-p, [J] min_p, then the q
///            probabilities
///   uniforms = [J, 2] u_accept, u_sample
/// The offsets below take J as the stride.
struct PackedRowSampling {
  int num_rows = 0;  ///< J
  std::vector<int> ints;
  std::vector<float> floats;
  std::vector<double> uniforms;

  // Offsets into `ints` / `floats` of each array above.
  static int top_k_at(int stride) { return stride; }
  static int draft_id_at(int stride) { return 2 * stride; }
  static int q_offsets_at(int stride) { return 3 * stride; }
  static int q_ids_at(int stride) { return 4 * stride + 1; }
  static int top_p_at(int stride) { return stride; }
  static int min_p_at(int stride) { return 2 * stride; }
  static int q_probs_at(int stride) { return 3 * stride; }
};

/// Packs the sampling jobs of `batch`, in batch order then logit-row
/// order. logit_row_start[i]: the first of sequence i's logit rows in the
/// step's concatenated logit rows (size batch.size() + 1).
/// capacity 0 (an eager step): a job for each logit row of the sequences
/// that sample (ForwardInput::sampling).
/// capacity > 0 (a graph step, whose arrays sit at fixed offsets): a job
/// for each of `capacity` rows; logit row r is job r,
/// and rows of greedy sequences and past the batch get a cheap placeholder
/// (top-k 1, no draft; their samples are not read). capacity must be at
/// least the batch's logit rows. Inputs must be valid (ValidateBatch).
PackedRowSampling PackRowSampling(absl::Span<const SequenceForward> batch,
                                  absl::Span<const int> logit_row_start,
                                  int capacity = 0);

/// The step's logit edits (ForwardInput::logit_edits) as ApplyLogitEdits
/// reads them: offsets [rows + 1] over the step's concatenated logit rows
/// (logit_row_start as for PackRowSampling), each sequence's rows edited
/// as its LogitEdits says, every other row (no edits, or past the batch up
/// to `rows`) an empty range, and the sequences' token masks (JSON mode)
/// concatenated, mask_of_row over all `rows` (-1 where a row has none;
/// empty when no sequence has masks). Empty (no offsets) when no sequence
/// has edits. rows >= the batch's logit rows; inputs valid
/// (ValidateBatch).
LogitEdits PackLogitEdits(absl::Span<const SequenceForward> batch,
                          absl::Span<const int> logit_row_start, int rows);

/// The rows a captured step is padded to: 1, 2, 4, 8, then multiples of 8
/// (vLLM's capture sizes). rows >= 1.
int GraphBucket(int rows);

/// Whether a step can run from a CUDA graph: every sequence greedy
/// (argmax_only), sampled on the device (ForwardInput::sampling) or asking
/// for its rows' logits (neither: they are copied out of the graph's
/// logits after the replay), without tree or logprobs, asking for the
/// logits of all its rows in order;
/// query capture only into a device capture (SequenceForward::capture;
/// rows captured for the host run eagerly), in a step without sampled
/// rows and of at most max_capture_rows captured rows in all (the
/// look-ahead steps of Speculative Prefill's scoring);
/// no sequence with >= flash_min_rows rows when `flash_min_rows` > 0 (those
/// go to FlashAttention, launched per sequence); at most max_rows rows in
/// all, at most max_q draft-distribution entries over the sampled rows and
/// at most max_edits logit edits (ForwardInput::logit_edits) in all, and
/// no token masks (those steps run eagerly: ApplyTokenMasks).
/// logit_rows: each entry's resolved rows (ValidateBatch).
bool GraphEligible(absl::Span<const SequenceForward> batch,
                   const std::vector<std::vector<int>>& logit_rows,
                   int max_rows, int flash_min_rows, int max_q,
                   int max_edits, int max_capture_rows);

/// Whether any sequence of `batch` samples on the device.
bool AnySampling(absl::Span<const SequenceForward> batch);


/// The inputs of a graph step padded to `bucket` rows, laid out for a
/// graph sized for `max_rows` rows:
///   head = [max_rows] ids, [max_rows] positions, [max_rows] KV slots,
///          [max_rows] logit rows; padding rows (from the real row count
///          to `bucket`) take id 0 at position 0, slot -1 (stores no KV)
///          and their own row as logit row, and belong to no sequence.
///   tables = the sequences' block tables, concatenated.
///   plan = PlanBatchedAttention over the real sequences (row starts and
///          table starts into the above).
struct GraphStepInputs {
  int rows = 0;    ///< real rows
  int bucket = 0;  ///< GraphBucket(rows)
  std::vector<int> head;
  std::vector<int> tables;
  cuda_kernels::BatchedAttentionPlan plan;
};

/// Builds GraphStepInputs for an eligible step (GraphEligible) whose
/// sequences' first new slots are first[i]. INVALID_ARGUMENT when the step
/// has more than max_rows rows or its tables more than max_tables
/// entries; PlanBatchedAttention's errors.
absl::StatusOr<GraphStepInputs> PackGraphStep(
    absl::Span<const SequenceForward> batch, absl::Span<const int> first,
    int max_rows, int max_tables, int num_heads, int num_kv_heads,
    int num_sms);

}  // namespace cuda_step
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_STEP_INPUTS_H_
