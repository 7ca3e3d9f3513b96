#ifndef SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_H_
#define SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/logits_processors.h"
#include "common/decoding/logprobs.h"
#include "common/decoding/sampling.h"
#include "common/engine/paged_kv_cache.h"
#include "common/model/config.h"
#include "common/specprefill/importance.h"

namespace specserve {

/// Sampling of a sequence's logit rows by the backend (temperature > 0):
/// every row runs specserve::SampleRow (common/decoding/row_sampling.h),
/// the row-parallel form of speculative sampling, so the CUDA backend
/// copies back one id and one accept flag per row instead of [rows, vocab]
/// fp32 logits. A plain sampling step is a row without a draft.
struct RowSampling {
  /// Valid (ValidateSamplingParams) and not greedy.
  SamplingParams params;
  /// [rows] (one per logit row, in logit-row order): the draft token the
  /// row verifies, -1 = none (the row is sampled from p).
  std::vector<int> draft_ids;
  /// [rows]: the draft's distribution for the row's draft (ValidateDrafts-
  /// valid, owned by the caller); null where draft_ids is -1.
  std::vector<const SparseDist*> draft_q;
  /// [rows, 2]: each row's u_accept, then u_sample, in [0, 1).
  std::vector<double> uniforms;
};

/// One sequence's new tokens in a forward pass, appended after whatever
/// its KV sequence already holds: a prefill chunk, one decode row, or the
/// k + 1 rows of a verify round.
struct ForwardInput {
  /// [n] token ids, each in [0, vocab).
  absl::Span<const int> token_ids;
  /// [n] RoPE position ids, each in [0, max_position_embeddings). Any order
  /// is accepted (Speculative Prefill passes the kept tokens' original,
  /// non-contiguous positions); attention is causal over the cache ORDER.
  absl::Span<const int> position_ids;
  /// Rows (indices into [0, n)) whose logits are returned. Empty = last row
  /// only. Rows nobody asked for never touch the vocabulary projection.
  std::vector<int> logit_rows;
  /// Rows whose post-RoPE queries are captured at every layer (Speculative
  /// Prefill scores the last prompt row and the look-ahead rows).
  std::vector<int> capture_query_rows;
  /// Tree attention (SpecInfer, Miao et al. 2024; Medusa): empty = causal
  /// over the cache order. Otherwise the parents of the LAST
  /// tree_parents.size() cache entries once this forward's n rows are
  /// appended (the span may start inside the new rows, or reach back into
  /// rows earlier forwards appended, so a draft tree can grow one depth per
  /// forward): tree_parents[j] in [-1, j) is entry j's parent within the
  /// span, -1 = none. A new row in the span attends to every key before the
  /// span, to its ancestors in the span and to itself; new rows before the
  /// span are causal. A chain (parents j - 1) is causal attention.
  std::vector<int> tree_parents;
  /// The caller needs only each logit row's argmax (greedy decoding and
  /// verification, the speculator's look-ahead): ForwardOutput::argmax is
  /// set and ForwardOutput::logits left empty. The CUDA backend reduces on
  /// the device and copies [rows] ids back instead of [rows, vocab] fp32
  /// logits (32 MB per step at 64 rows of a 128K vocabulary).
  bool argmax_only = false;
  /// Sample the logit rows on the backend (not with argmax_only): set
  /// ForwardOutput::sampled and ::accepted, leave ::logits empty. Owned by
  /// the caller; null = return logits (or argmax).
  const RowSampling* sampling = nullptr;
  /// With argmax_only or sampling, >= 0 also returns each decided row's
  /// log-probability of the token it produced (its argmax; its accepted
  /// draft or sampled token) and its top `logprobs_top_n` alternatives, as
  /// specserve::ComputeTokenLogprobs computes them from the raw logits
  /// (OpenAI logprobs, vLLM's raw_logprobs), in
  /// ForwardOutput::token_logprobs. So a backend still returns no logits.
  /// -1 = none; at most kMaxTopLogprobs.
  int logprobs_top_n = -1;
  /// Empty, or [logit rows] with argmax_only and logprobs_top_n >= 0: the
  /// id each row's logprob is of, in place of its argmax (teacher forcing:
  /// a prompt row's logprob of the next prompt token, vLLM's
  /// prompt_logprobs); -1 = the row's argmax. ForwardOutput::argmax is
  /// still each row's argmax.
  std::vector<int> logprob_ids;
  /// A request's logit adjustments (logit bias, penalties, the min_tokens
  /// mask, JSON mode's mask; logits_processors.h, json_grammar.h), one row
  /// of edits per logit row, applied
  /// before the rows are decided (argmax_only or sampling): so adjusted
  /// requests are decided where the logits are, and the CUDA backend
  /// copies back ids, not [rows, vocab] logits. Needs argmax_only or
  /// sampling and no logprobs (those are of the raw logits). Owned by the
  /// caller; null = none. Ids distinct within a row, in [0, vocab); bias
  /// finite, scale finite and > 0, subtract finite or +inf (a mask).
  const LogitEdits* logit_edits = nullptr;
};

/// One sequence's output of a forward pass.
struct ForwardOutput {
  /// The rows `logits` holds, in order (resolved from logit_rows).
  std::vector<int> logit_rows;
  /// [logit_rows.size(), vocab] fp32 logits; empty with argmax_only.
  std::vector<float> logits;
  /// [logit_rows.size()] with ForwardInput::argmax_only: each row's largest
  /// logit's id (specserve::Argmax: ties -> lowest id, NaN never wins).
  std::vector<int> argmax;
  /// [logit_rows.size()] with ForwardInput::sampling: each row's
  /// RowSample (SampleRow): the sampled token (-1 where the row's draft was
  /// accepted) and whether the draft was accepted (0 / 1). A backend may
  /// stop after the first row that is not accepted (verification reads no
  /// further): the rows after it then read token -1, not accepted. The
  /// host backends stop there (each row costs a ComputeDistribution); the
  /// CUDA backend decides every row.
  std::vector<int> sampled;
  std::vector<uint8_t> accepted;
  /// With ForwardInput::logprobs_top_n >= 0: per decided row (every row
  /// with argmax_only; with sampling at least the rows up to the first one
  /// not accepted), the logprobs of the token the row produced.
  std::vector<TokenLogprobs> token_logprobs;
  /// [num_layers, capture_query_rows.size(), num_heads, head_dim] post-RoPE
  /// queries, layer-major; empty when no rows were captured or they went
  /// to a QueryCapture.
  std::vector<float> queries;

  const float* logits_row(int i, int vocab) const {
    return logits.data() + static_cast<size_t>(i) * vocab;
  }
};

/// Post-RoPE queries of Speculative Prefill's scoring rows, kept where the
/// backend computes (host or device) across forward passes: the last prompt
/// row from the prefill, then one row per look-ahead step. Created by
/// ModelRunner::NewQueryCapture; read by ModelRunner::ScoreImportance.
class QueryCapture {
 public:
  virtual ~QueryCapture() = default;
  /// Rows captured so far, in capture order.
  virtual int rows() const = 0;
  virtual int max_rows() const = 0;
  /// Forgets every captured row.
  virtual void Clear() = 0;
  /// fp32 [num_layers, rows(), num_heads, head_dim] on the host (the
  /// layout of ForwardOutput::queries). Backend errors as INTERNAL.
  virtual absl::StatusOr<std::vector<float>> CopyToHost() const = 0;
};

/// The longest tree span ForwardInput::tree_parents may have (a node
/// budget of 64; the CUDA kernels keep a row's visibility in 64 bits).
inline constexpr int kMaxTreeSpan = 64;

/// The keys tree attention hides from each new row, in compressed-row
/// form: row i (of n new rows, appended at cache index `first`) must not
/// see keys masked_keys[offsets[i] .. offsets[i + 1]) (cache indices, all
/// in the span and below first + i). Built by TreeAttentionMask.
struct TreeMask {
  std::vector<int> offsets;      ///< [n + 1]
  std::vector<int> masked_keys;  ///< cache indices, ascending per row
  bool empty() const { return masked_keys.empty(); }
};

/// The mask of `tree_parents` (ForwardInput) for n new rows appended at
/// cache index `first`, listed from TreeSpanBits; an empty mask for causal
/// input. tree_parents must be valid (ValidateForwardInput with the
/// sequence's size: at most kMaxTreeSpan entries).
TreeMask TreeAttentionMask(absl::Span<const int> tree_parents, int first,
                           int n);

/// The same mask as bits (the CUDA kernels' form), for n new rows appended
/// at cache index `first`: starts[i] is the cache index row i's span
/// begins at (INT_MAX for rows before the span) and bit j of bits[i] is set
/// iff span entry j is visible to row i (its ancestors and itself).
/// Returns false, writing nothing, for causal input. starts and bits have
/// room for n entries; tree_parents must be valid (at most kMaxTreeSpan).
bool TreeSpanBits(absl::Span<const int> tree_parents, int first, int n,
                  int* starts, uint64_t* bits);

/// One entry of a batched forward.
struct SequenceForward {
  KvSequence* kv = nullptr;  ///< the sequence's cache; appended to.
  ForwardInput input;
  /// If set, the captured queries are appended here (on the backend's
  /// device) instead of ForwardOutput::queries.
  QueryCapture* capture = nullptr;
};

/// Speculative Prefill importance of one prompt (docs/ARCHITECTURE.md, Speculative Prefill,
/// steps 3-5).
struct ImportanceResult {
  std::vector<float> importance;                       ///< [prompt_len]
  std::vector<std::vector<float>> per_row_importance;  ///< [rows][prompt_len]
};

/// Checks one sequence's input against the model (every backend rejects
/// the same inputs with the same messages): INVALID_ARGUMENT for an empty
/// batch, mismatched lengths, a token id outside the vocabulary, a position
/// outside [0, max_position_embeddings), a logit / capture row outside
/// [0, n), or `sampling` that does not match the logit rows (sizes, params
/// greedy or invalid, argmax_only also set, a draft id or a q id outside
/// the vocabulary, a missing q, a uniform outside [0, 1)), or
/// logprob_ids not one per logit row, outside [-1, vocab) or without
/// argmax_only and logprobs_top_n >= 0. With `cached` >= 0 (the sequence's size before the forward)
/// also tree_parents: INVALID_ARGUMENT unless its size is at most
/// min(cached + n, kMaxTreeSpan) and every entry j is in [-1, j). Returns the logit rows
/// to compute (the last row when none were asked for).
absl::StatusOr<std::vector<int>> ValidateForwardInput(const ModelConfig& config,
                                                      const ForwardInput& in,
                                                      int cached = -1);

/// The model engine's one interface, implemented by the CPU
/// (CpuModelRunner) and CUDA (CudaModelRunner) backends: a Llama-family
/// forward over a BATCH of sequences, each contributing any number of new
/// tokens at explicit position ids, over the runner's one paged KV cache
/// (vLLM v1's GPUModelRunner + KVCacheManager split). The linear layers run
/// over the concatenated rows of all sequences at once (the weights are
/// read once per batch); attention runs per sequence over its own blocks.
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const ModelConfig& config() const = 0;
  /// "cpu" or "cuda".
  virtual std::string backend() const = 0;
  /// The KV cache every sequence of this model lives in.
  virtual PagedKvCache& kv_cache() = 0;

  /// A new empty sequence in kv_cache() with room for `max_tokens` tokens
  /// (INVALID_ARGUMENT unless 1 <= max_tokens <= max_position_embeddings).
  absl::StatusOr<std::unique_ptr<KvSequence>> NewSequence(int max_tokens);

  /// Room for `max_rows` captured query rows. INVALID_ARGUMENT if
  /// max_rows < 1; RESOURCE_EXHAUSTED / INTERNAL from device allocation.
  virtual absl::StatusOr<std::unique_ptr<QueryCapture>> NewQueryCapture(
      int max_rows) = 0;

  /// Runs every entry of `batch` in one forward pass: appends each entry's
  /// keys and values to its sequence and fills (*out)[i] for batch[i].
  /// Sequences must be distinct and belong to kv_cache().
  /// Errors (then nothing is appended to any sequence or capture):
  /// INVALID_ARGUMENT for an empty batch, a null or repeated sequence, or
  /// an entry ValidateForwardInput rejects (the message names the entry);
  /// RESOURCE_EXHAUSTED when a sequence is at its max_tokens, the pool has
  /// no free block, or a capture is full; INTERNAL for backend failures.
  virtual absl::Status Forward(absl::Span<const SequenceForward> batch,
                               std::vector<ForwardOutput>* out) = 0;

  /// One-sequence convenience form of Forward.
  absl::Status Forward(const ForwardInput& in, KvSequence* kv,
                       ForwardOutput* out);

  /// Speculative Prefill scoring: every row of `capture` against the first
  /// `prompt_len` cached keys of `kv`, reduced layer by layer
  /// (ImportanceAccumulator semantics; `num_threads` for the CPU's
  /// reduction). INVALID_ARGUMENT for an empty capture, prompt_len outside
  /// [1, kv.size()] or bad options; INTERNAL for backend failures.
  virtual absl::StatusOr<ImportanceResult> ScoreImportance(
      const KvSequence& kv, int prompt_len, const QueryCapture& capture,
      const ScoringOptions& options, int num_threads) = 0;
};

/// Shared checks of a batch (distinct, non-null sequences of `cache`,
/// inputs valid): returns each entry's resolved logit rows, or the first
/// error with "batch[i]: " prefixed.
absl::StatusOr<std::vector<std::vector<int>>> ValidateBatch(
    const ModelConfig& config, const PagedKvCache& cache,
    absl::Span<const SequenceForward> batch);

/// For the host backends: each output whose input asked argmax_only gets
/// its rows' argmax (specserve::Argmax) and drops its logits. out:
/// [batch.size()] outputs of `batch`, logits [rows, vocab] each.
void ReduceToArgmax(absl::Span<const SequenceForward> batch, int vocab,
                    std::vector<ForwardOutput>* out);

/// For the host backends: each output whose input asked for `sampling`
/// gets its rows' SampleRow outcomes and drops its logits. out:
/// [batch.size()] outputs of `batch`, logits [rows, vocab] each.
void SampleOnHost(absl::Span<const SequenceForward> batch, int vocab,
                  std::vector<ForwardOutput>* out);

/// Shared checks of ScoreImportance's arguments. `capture` is the caller's
/// capture cast to the backend's own type (nullptr when it belongs to
/// another backend). INVALID_ARGUMENT for another backend's or an empty
/// capture, or prompt_len outside [1, kv.size()].
absl::Status ValidateScoringInput(const QueryCapture* capture,
                                  const KvSequence& kv, int prompt_len);

/// Reserves each entry's new slots in its sequence (and records their
/// positions); on failure rolls back the entries already reserved and
/// returns the error. Fills `first[i]` with entry i's first new slot.
absl::Status ReserveBatch(absl::Span<const SequenceForward> batch,
                          std::vector<int>* first);

/// Undoes ReserveBatch: truncates every entry back to first[i].
void UnreserveBatch(absl::Span<const SequenceForward> batch,
                    const std::vector<int>& first);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_H_
