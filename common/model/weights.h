#ifndef SPECSERVE_COMMON_MODEL_WEIGHTS_H_
#define SPECSERVE_COMMON_MODEL_WEIGHTS_H_

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

namespace specserve {

/// One decoder layer's parameters in fp32, row-major PyTorch Linear layout
/// [out, in] (y = x W^T). Projections that read the same input are fused so
/// one GEMM computes them (FasterTransformer's LlamaDecoderLayerWeight).
struct LayerWeights {
  std::vector<float> attn_norm;  ///< [hidden] input_layernorm.
  std::vector<float> wqkv;       ///< [(H + 2*KV) * head_dim, hidden]: q, k, v rows.
  std::vector<float> wo;         ///< [hidden, H * head_dim] o_proj.
  std::vector<float> mlp_norm;   ///< [hidden] post_attention_layernorm.
  std::vector<float> w_gate_up;  ///< [2 * ffn, hidden]: gate rows then up rows.
  std::vector<float> w_down;     ///< [hidden, ffn] down_proj.
  /// [(H + 2*KV) * head_dim] q, k, v biases; empty unless
  /// config.has_qkv_bias() (Qwen2).
  std::vector<float> bqkv;
  std::vector<float> bo;  ///< [hidden] o_proj bias; empty unless has_o_bias().
  /// [head_dim] per-head RMSNorm weights of q and k (Qwen3); empty unless
  /// config.has_qk_norm().
  std::vector<float> q_norm, k_norm;
};

/// All parameters of a Llama model, kept apart from the compute that uses
/// them (the Transformer). Plain data: no methods that compute.
struct ModelWeights {
  ModelConfig config;
  std::vector<float> embed;       ///< [vocab, hidden] embed_tokens.
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  ///< [hidden] model.norm.
  /// [vocab, hidden]; empty when tied (then lm_head() returns embed).
  std::vector<float> lm_head_weight;

  const float* lm_head() const {
    return lm_head_weight.empty() ? embed.data() : lm_head_weight.data();
  }
  /// The element type the checkpoint stores its Linear weights in (layer
  /// 0's q_proj; F32, F16 or BF16): what `--weight_dtype auto` keeps.
  DType checkpoint_dtype = DType::kF32;

  /// Total parameter bytes held (fp32), counting a tied lm_head once.
  size_t bytes() const;
};

/// A Linear weight [rows(), cols] in the checkpoint's own bytes: row-major
/// blocks stacked top to bottom (e.g. q, k and v of a fused wqkv), each in
/// its stored dtype. Valid only while the loader's callback runs (it views
/// the mapped file). Lets a caller pack straight from the file instead of
/// through an fp32 copy.
struct LinearView {
  std::vector<RawTensor> blocks;  ///< each [rows_i, cols], rows_i >= 0
  int64_t cols = 0;

  /// Sum of the blocks' rows.
  int64_t rows() const;
  /// Writes rows [begin, end) (end <= rows()) as fp32 to dst [end - begin,
  /// cols]; F16 and BF16 widen exactly.
  void RowsToFloat(int64_t begin, int64_t end, float* dst) const;
};

/// The four Linear weights of a decoder layer as views, in LayerWeights'
/// fused layouts: wqkv [q; k; v], wo, w_gate_up [gate; up], w_down.
struct LayerLinearViews {
  LinearView wqkv, wo, w_gate_up, w_down;
};

/// Loads config.json and model.safetensors (or the shards listed in
/// model.safetensors.index.json) from `model_dir`, converting F16/BF16 to
/// fp32. Tied checkpoints may store either `model.embed_tokens.weight` or
/// `lm_head.weight`. Per layer, `self_attn.{q,k,v}_proj.bias` are read when
/// config.has_qkv_bias(), `self_attn.o_proj.bias` when has_o_bias(), and
/// `self_attn.{q,k}_norm.weight` when has_qk_norm(); a bias or norm the
/// config does not imply is an unexpected tensor. Every tensor the config implies must be present with
/// the right shape: errors are INVALID_ARGUMENT / NOT_FOUND naming the file
/// and tensor.
absl::StatusOr<ModelWeights> LoadModelWeights(const std::string& model_dir);

/// Options of LoadModelWeights.
struct LoadWeightsOptions {
  /// Called for each decoder layer, in order, as soon as it has been read,
  /// with the weights read so far (config, checkpoint_dtype, the embedding
  /// table and lm_head set; later layers empty). It may take the layer's
  /// vectors (the returned ModelWeights then has them empty), so a caller
  /// can convert the model layer by layer instead of holding all of it in
  /// f32. A non-OK status stops loading and is returned.
  std::function<absl::Status(const ModelWeights& partial, int layer,
                             LayerWeights* weights)>
      on_layer;
  /// When set, the loader converts no Linear weight to fp32: each layer's
  /// four projections are handed to on_linear_layer as views of the file
  /// (after the same shape and dtype checks), right after on_layer, and
  /// LayerWeights' wqkv, wo, w_gate_up and w_down stay empty. The views'
  /// file pages are released (madvise) once it returns.
  std::function<absl::Status(const ModelWeights& partial, int layer,
                             const LayerLinearViews& views)>
      on_linear_layer;
  /// Likewise for the embedding table and, when untied, lm_head (nullptr
  /// when tied): with on_embeddings set, `embed` and `lm_head_weight` stay
  /// empty. Called before the first layer, with `partial` holding the
  /// config and checkpoint_dtype.
  std::function<absl::Status(const ModelWeights& partial,
                             const LinearView& embed,
                             const LinearView* lm_head)>
      on_embeddings;
};

/// As above, with `options`.
absl::StatusOr<ModelWeights> LoadModelWeights(
    const std::string& model_dir, const LoadWeightsOptions& options);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_WEIGHTS_H_
