#ifndef SPECSERVE_COMMON_ENGINE_TRANSFORMER_H_
#define SPECSERVE_COMMON_ENGINE_TRANSFORMER_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/engine/kv_cache.h"
#include "common/model/weights.h"

namespace specserve {

/// One forward pass's input: a batch of new tokens of ONE sequence, appended
/// after whatever the KV cache already holds.
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
};

/// One forward pass's output.
struct ForwardOutput {
  /// The rows `logits` holds, in order (resolved from logit_rows).
  std::vector<int> logit_rows;
  /// [logit_rows.size(), vocab] fp32 logits.
  std::vector<float> logits;
  /// [num_layers, capture_query_rows.size(), num_heads, head_dim] post-RoPE
  /// queries, layer-major; empty when no rows were captured.
  std::vector<float> queries;

  const float* logits_row(int i, int vocab) const {
    return logits.data() + static_cast<size_t>(i) * vocab;
  }
};

/// Checks one forward's input against the model (shared by the CPU and
/// CUDA backends so both reject the same inputs with the same messages):
/// INVALID_ARGUMENT for an empty batch, mismatched lengths, a token id
/// outside the vocabulary, a position outside [0, max_position_embeddings)
/// or a logit / capture row outside [0, n). Returns the logit rows to
/// compute (the last row when none were asked for).
absl::StatusOr<std::vector<int>> ValidateForwardInput(const ModelConfig& config,
                                                      const ForwardInput& in);

/// CPU Llama forward (HF LlamaForCausalLM semantics, fp32): embedding,
/// RMSNorm, rotate_half RoPE at explicit position ids, grouped-query causal
/// attention over the cached + new tokens, SiLU-gated MLP, final norm, tied
/// or separate lm_head. GEMMs through OpenBLAS (sgemm / sgemv); the rest is
/// AVX2 code in kernels.h.
///
/// The Transformer holds only a pointer to immutable weights and no
/// per-call state, so one instance serves many sequences concurrently, each
/// with its own KvCache. (Batching several sequences in one forward is a
/// later step: ForwardInput is per sequence so a batch is a list of them.)
class Transformer {
 public:
  explicit Transformer(std::shared_ptr<const ModelWeights> weights);

  const ModelConfig& config() const { return weights_->config; }
  const ModelWeights& weights() const { return *weights_; }

  /// Runs `in` after the tokens already in `cache`, appends their keys and
  /// values to it and fills `out`. Errors (nothing is appended):
  /// INVALID_ARGUMENT for an empty batch, mismatched lengths, a token id
  /// outside the vocabulary, a position outside [0, max_position_embeddings)
  /// or a row outside [0, n); RESOURCE_EXHAUSTED when the cache is full.
  absl::Status Forward(const ForwardInput& in, KvCache* cache,
                       ForwardOutput* out) const;

 private:
  // Per-forward scratch of Attention, reused across layers (the block
  // shape depends only on n, the cache length and the GQA group).
  struct AttentionScratch {
    std::vector<float> qg, og, scores;
  };
  void Attention(int layer, int n, int first, const float* qkv,
                 KvCache* cache, float* attn_out,
                 AttentionScratch* scratch) const;

  std::shared_ptr<const ModelWeights> weights_;
};

/// Sets the number of threads OpenBLAS uses for the engine's GEMMs
/// (process-wide). n <= 0 keeps the library's default.
void SetEngineThreads(int n);

/// If the CPU has AVX-512 and OPENBLAS_CORETYPE is unset, re-executes the
/// current program with OPENBLAS_CORETYPE=SkylakeX so Debian's OpenBLAS picks
/// its AVX-512 kernels (it reads the variable only when the library loads).
/// Call first thing in main(); returns only when no re-exec happened.
void MaybeReexecForAvx512(char** argv);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_TRANSFORMER_H_
