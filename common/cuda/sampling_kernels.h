#ifndef SPECSERVE_COMMON_CUDA_SAMPLING_KERNELS_H_
#define SPECSERVE_COMMON_CUDA_SAMPLING_KERNELS_H_

// Row-parallel speculative sampling on the device: specserve::SampleRow
// (common/decoding/row_sampling.h) for many logit rows in one launch, so a
// step returns one id per row instead of [rows, vocab] logits. The kernel is
// in sampling.cu; this header is plain C++ for host code compiled by g++.
//
// Conventions as kernels.h: every pointer is DEVICE memory; the launcher
// enqueues on `stream`, does not synchronise, and returns
// cudaGetLastError() after its launch (a kernel fault surfaces at the next
// synchronising call).

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/decoding/logit_edit.h"

namespace specserve {
namespace cuda_kernels {

/// Arguments of SampleRows. Sampled row i reads logits row logit_row[i] and
/// its own entry of every per-row array.
struct SampleRowsArgs {
  /// fp32 [*, vocab] logits (read only).
  const float* logits = nullptr;
  int vocab = 0;
  /// Rows to sample (one block each).
  int num_rows = 0;
  /// int [num_rows]: the logits row each sampled row reads (in range).
  const int* logit_row = nullptr;
  /// fp32 [num_rows]: temperature, each finite and > 0 (greedy rows are
  /// ArgmaxRows' job).
  const float* temperature = nullptr;
  /// int [num_rows]: top-k, 0 = off (>= vocab = off too).
  const int* top_k = nullptr;
  /// fp32 [num_rows]: top-p in (0, 1]; 1 = off.
  const float* top_p = nullptr;
  /// fp32 [num_rows]: min_p in [0, 1], 0 = off (ComputeDistribution's:
  /// keys below the logit max + T ln(min_p) leave the support before
  /// top-k and top-p). Null = 0 for every row.
  const float* min_p = nullptr;
  /// int [num_rows]: the row's draft token, -1 = no draft (plain sample).
  /// Null = no row has a draft (q_* may then be null too).
  const int* draft_id = nullptr;
  /// int [num_rows + 1]: row i's draft distribution q is entries
  /// [q_offsets[i], q_offsets[i + 1]) of q_ids / q_probs. Required with
  /// draft_id; rows without a draft may have an empty range.
  const int* q_offsets = nullptr;
  /// int [q_offsets[num_rows]]: token ids, each in [0, vocab), distinct
  /// within a row.
  const int* q_ids = nullptr;
  /// fp32 [q_offsets[num_rows]]: their probabilities (ValidateDrafts-valid:
  /// q(draft) > 0, summing to 1).
  const float* q_probs = nullptr;
  /// double [num_rows, 2]: u_accept, u_sample of each row, each in [0, 1).
  const double* uniforms = nullptr;
  /// Device workspace of SampleRowsScratchBytes(num_rows, vocab) bytes
  /// (contents on entry do not matter; clobbered).
  void* scratch = nullptr;
  /// int [num_rows] out: the sampled token, -1 when the draft was accepted.
  int* token = nullptr;
  /// int [num_rows] out: 1 if the row's draft was accepted, else 0.
  int* accepted = nullptr;
};

/// Bytes of SampleRowsArgs::scratch: one fp32 [vocab] row per sampled row
/// (num_rows * vocab * 4); 0 when either is <= 0.
size_t SampleRowsScratchBytes(int num_rows, int vocab);

/// SampleRow for every row i < num_rows, with p = ComputeDistribution(logits
/// row, {temperature, top_k, top_p}) and the draft test / residual draw /
/// ascending-id inverse-CDF draw of row_sampling.h. Results equal the host
/// SampleRow's except where float/double rounding of the sums decides a
/// boundary (a uniform or top-p within ~1e-12 relative of a cumulative
/// mass). An all -inf / NaN logits row samples token 0 (host rule). One
/// block per row; cost per row grows with vocab (several passes over the
/// logits row).
///
/// cudaErrorInvalidValue (checked on the host, before any CUDA call) for
/// vocab <= 0, num_rows < 0, a null logits / logit_row / temperature /
/// top_k / top_p / uniforms / scratch / token / accepted, or a non-null
/// draft_id with a null q_offsets / q_ids / q_probs. num_rows == 0 is a
/// no-op (cudaSuccess, pointers unchecked, nothing launched).
cudaError_t SampleRows(const SampleRowsArgs& args, cudaStream_t stream);

/// A request's logit adjustments (logit bias, penalties, the min_tokens
/// mask) on the device, before ArgmaxRows / SampleRows decide the rows:
/// logits row r ([num_rows, vocab] fp32, in place) gets
/// specserve::ApplyLogitEdit (common/decoding/logit_edit.h, the host's
/// arithmetic, so rows equal the host's bit for bit) for each of edits
/// [offsets[r], offsets[r + 1]), whose ids must be distinct within a row
/// (ids outside [0, vocab) are skipped). offsets: int [num_rows + 1]; both
/// may be read by a CUDA graph replay, so a row without edits is an empty
/// range. One block per row.
/// cudaErrorInvalidValue, before any launch, for vocab < 1, num_rows < 0 or
/// a null pointer; num_rows == 0 launches nothing.
cudaError_t ApplyLogitEdits(float* logits, int vocab, int num_rows,
                            const int* offsets, const LogitEdit* edits,
                            cudaStream_t stream);

/// The token masks of LogitEdits (logits_processors.h; JSON mode's
/// grammar) on the device: every id of row r whose bit in mask
/// mask_of_row[r] is clear becomes -inf, as the host's ApplyLogitEdits
/// does; rows with mask -1 are left alone. A mask is `words` =
/// ceil(vocab / 32) uint32 (bit id % 32 of word id / 32 = allowed), so a
/// step uploads vocab / 8 bytes a masked row instead of an edit per
/// masked id. logits: fp32 [num_rows, vocab]; mask_of_row: int
/// [num_rows]; allowed: uint32 [masks, words]. One thread per word.
/// cudaErrorInvalidValue, before any launch, for vocab < 1, num_rows < 0,
/// words != ceil(vocab / 32) or a null pointer; num_rows == 0 launches
/// nothing.
cudaError_t ApplyTokenMasks(float* logits, int vocab, int num_rows,
                            const int* mask_of_row, const uint32_t* allowed,
                            int words, cudaStream_t stream);

/// specserve::ComputeTokenLogprobs (common/decoding/logprobs.h) on the
/// device for `num_rows` jobs, one block each (logprobs.cu): job j's
/// log-softmax of logits row rows[j] at token tokens[j], and the row's top
/// `top_n` (id, logprob) pairs, descending, ties to the lower id; NaN
/// logits count as -inf; max-shifted log-sum-exp summed in double. So a
/// step that wants logprobs copies back [rows, 1 + 2 * top_n] values, not
/// [rows, vocab] logits.
/// logits: fp32 [*, vocab]; rows, tokens: int [num_rows] (a token outside
/// [0, vocab) gets NaN); out_logprob: fp32 [num_rows]; out_top_ids: int
/// [num_rows, top_n]; out_top_logprobs: fp32 [num_rows, top_n] (both may be
/// null when top_n == 0). top_n in [0, min(vocab, 64)].
/// cudaErrorInvalidValue, before any launch, for vocab < 1, num_rows < 0,
/// top_n out of range or a missing pointer; num_rows == 0 launches nothing.
cudaError_t RowLogprobs(const float* logits, int vocab, const int* rows,
                        const int* tokens, int num_rows, int top_n,
                        float* out_logprob, int* out_top_ids,
                        float* out_top_logprobs, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_SAMPLING_KERNELS_H_
