#ifndef SPECSERVE_COMMON_SPECPREFILL_IMPORTANCE_H_
#define SPECSERVE_COMMON_SPECPREFILL_IMPORTANCE_H_

// Token-importance scoring of Speculative Prefill (Liu, Chen, Zhang, ICML
// 2025, arXiv 2502.02789, section 3.2; docs/ARCHITECTURE.md, Speculative Prefill steps 3-5,
// which follow the official code): every scoring row (the last prompt token
// plus the look-ahead tokens) attends to the PROMPT keys only; the attention
// probabilities are smoothed along the prompt, maxed over layers x heads and
// averaged over rows.

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specserve {

/// Knobs of the scoring step. Official defaults (configs/*_full_lah8.yaml):
/// pool kernel 13, all layers, max over layers x heads.
struct ScoringOptions {
  /// avg_pool1d kernel along the prompt; odd and >= 1, 1 = no pooling.
  int pool_kernel_size = 13;
  /// 0 = all layers, else only the last `num_layers_used` layers score.
  int num_layers_used = 0;
  enum class Aggregation { kMax, kMean };
  /// Reduction over layers x heads (per row, per prompt token). The paper
  /// and the official code use kMax; kMean is an ablation.
  Aggregation head_layer_aggregation = Aggregation::kMax;
};

/// OK if `opts` is usable with a model of `num_layers` layers, else
/// INVALID_ARGUMENT naming the field (pool_kernel_size even or < 1,
/// num_layers_used < 0 or > num_layers, unknown head_layer_aggregation).
absl::Status ValidateScoringOptions(const ScoringOptions& opts, int num_layers);

/// torch.nn.functional.avg_pool1d(x, kernel, stride=1, padding=kernel/2,
/// count_include_pad=True) on one row: zero padding, every output divided by
/// `kernel`. `kernel` must be odd and >= 1 (asserted). Output has x.size()
/// elements. Exposed for tests; the accumulator uses the same routine.
std::vector<float> AvgPool1d(absl::Span<const float> x, int kernel);

/// Argument checks of an AddLayer call shared by the CPU and CUDA
/// accumulators: INVALID_ARGUMENT for a layer outside [0, num_layers), a
/// null queries or keys pointer, or key_row_stride (elements) smaller than
/// num_kv_heads * head_dim.
absl::Status CheckAddLayerArgs(int layer, int num_layers, const void* queries,
                               const void* keys, size_t key_row_stride,
                               int num_kv_heads, int head_dim);

/// Accumulates per-token importance layer by layer, so the full
/// [layers, heads, rows, prompt_len] score tensor is never held: only the
/// running max (or sum, for kMean) of shape [rows, prompt_len] plus
/// O(heads * rows * prompt_len) per-layer scratch (the logits of one layer).
///
/// Usage: construct (or Create), AddLayer for every layer with
/// UsesLayer(layer) true (others are accepted and ignored), then read
/// Importance() / PerRowImportance().
///
/// Not thread-safe: one caller at a time. AddLayer itself may fan out over
/// `num_threads` worker threads (the q.k products split over ranges of
/// prompt tokens, then softmax/pooling split over kv heads and row blocks);
/// results do not depend on the thread count.
///
/// Cost at Llama-3.2-1B shapes, 9 rows, 8K prompt, one thread of the 2-core
/// dev machine: ~9 ms per layer (~0.2% of the 1B model's own prefill; see
/// bench/specprefill_scoring_bench). Scratch then is ~10 MB (the logits).
class ImportanceAccumulator {
 public:
  /// Shapes: `prompt_len` prompt tokens (keys), `num_rows` scoring rows
  /// (queries), `num_heads` query heads sharing `num_kv_heads` kv heads
  /// (GQA; num_heads % num_kv_heads == 0), `head_dim` per head, the model
  /// has `num_layers` layers. Invalid shapes or options do not abort: they
  /// are recorded in status() and every AddLayer returns that error.
  ImportanceAccumulator(int prompt_len, int num_rows, int num_heads,
                        int num_kv_heads, int head_dim, int num_layers,
                        const ScoringOptions& opts);

  /// Like the constructor but returns INVALID_ARGUMENT (naming the argument
  /// or ScoringOptions field) instead of a poisoned object.
  static absl::StatusOr<ImportanceAccumulator> Create(
      int prompt_len, int num_rows, int num_heads, int num_kv_heads,
      int head_dim, int num_layers, const ScoringOptions& opts);

  ImportanceAccumulator(ImportanceAccumulator&&) = default;
  ImportanceAccumulator& operator=(ImportanceAccumulator&&) = default;

  /// OK, or why the constructor's arguments are invalid.
  const absl::Status& status() const { return status_; }

  /// Worker threads AddLayer may use (>= 1; values <= 0 mean
  /// std::thread::hardware_concurrency()). Default 1.
  void set_num_threads(int num_threads);
  int num_threads() const { return num_threads_; }

  /// Whether layer `layer` (0-based) contributes, per
  /// ScoringOptions::num_layers_used (the last k layers, or all).
  bool UsesLayer(int layer) const;

  /// Folds one layer in.
  /// `queries`: [num_rows, num_heads, head_dim] post-RoPE queries of the
  ///   scoring rows at this layer, row-major and contiguous.
  /// `keys`: post-RoPE prompt keys at this layer; prompt token i's
  ///   [num_kv_heads, head_dim] lies at keys + i * key_row_stride (floats).
  ///   Only the first prompt_len token rows are read, so a KV cache holding
  ///   look-ahead tokens after the prompt can be passed as is.
  /// Computes logits = q.k / sqrt(head_dim) (query head h reads kv head
  /// h / (num_heads / num_kv_heads)), softmax over the prompt in fp32
  /// (max-subtracted), AvgPool1d(pool_kernel_size), then the running max
  /// (kMax) or sum (kMean) over layers x heads, per row and token.
  /// Errors: status() if not OK; INVALID_ARGUMENT for layer out of
  /// [0, num_layers), null pointers, or key_row_stride <
  /// num_kv_heads * head_dim; FAILED_PRECONDITION if `layer` was already
  /// added. A layer with UsesLayer(layer) false returns OK and changes
  /// nothing.
  absl::Status AddLayer(int layer, const float* queries, const float* keys,
                        size_t key_row_stride);

  /// Number of used layers added so far, and whether all used layers are in.
  int layers_added() const { return layers_added_; }
  bool complete() const;

  /// Per-row importance [num_rows][prompt_len]: the max (kMax) or mean
  /// (kMean) over the layers added so far x heads. All zeros before any
  /// layer was added; empty if status() is not OK.
  std::vector<std::vector<float>> PerRowImportance() const;

  /// Importance [prompt_len]: PerRowImportance() averaged over rows
  /// (the paper's mean over look-ahead steps).
  std::vector<float> Importance() const;

 private:
  // Phase 1 of AddLayer: logits_ for key blocks [block_begin, block_end)
  // (16 prompt tokens each), all kv heads. `kt` is 32-byte aligned scratch
  // of num_kv_heads * 16 * head_dim floats.
  void ComputeLogits(int block_begin, int block_end, const float* keys,
                     size_t key_row_stride, float* kt);
  // Phase 2: softmax + pooling of kv head g's logit rows for scoring rows
  // [row_begin, row_end), reduced (max or sum) over the group's query heads
  // into partial_[g][row]. `scratch` holds prompt_len + pool scratch floats.
  void ReduceKvHead(int g, int row_begin, int row_end, float* scratch);

  absl::Status status_;
  int prompt_len_ = 0;
  int num_rows_ = 0;
  int num_heads_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  int num_layers_ = 0;
  ScoringOptions opts_;
  int num_threads_ = 1;
  int layers_added_ = 0;
  std::vector<bool> added_;     // [num_layers]
  std::vector<float> running_;  // [num_rows, prompt_len] max or sum
  // Per-layer scratch, reused across layers. Worker threads write disjoint
  // slices; partial_ is folded into running_ in kv-head order, so results do
  // not depend on the thread count.
  std::vector<float> q_;        // [kv_heads, rows, group, head_dim] scaled
  std::vector<float> logits_;   // [kv_heads, rows, group, prompt_len]
  std::vector<float> partial_;  // [kv_heads, rows, prompt_len]
  std::vector<std::vector<float>> scratch_;  // one buffer per worker
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECPREFILL_IMPORTANCE_H_
