#ifndef SPECSERVE_COMMON_MODEL_CONFIG_H_
#define SPECSERVE_COMMON_MODEL_CONFIG_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace specserve {

/// `rope_scaling` of a HF config.json (transformers' modeling_rope_utils).
/// `type` empty means none (null, absent or "default").
struct RopeScaling {
  std::string type;  ///< "", "linear", "llama3" or "yarn".
  double factor = 1.0;  ///< context extension factor (all three types).
  double low_freq_factor = 1.0;   ///< llama3.
  double high_freq_factor = 4.0;  ///< llama3.
  /// llama3 (required) and yarn (optional; 0 = max_position_embeddings).
  int original_max_position_embeddings = 0;
  double beta_fast = 32.0;  ///< yarn ramp bounds, in rotations.
  double beta_slow = 1.0;
  /// yarn: explicit `attention_factor`; 0 = derived from factor / mscale.
  double attention_factor = 0.0;
  double mscale = 0.0;          ///< yarn (DeepSeek style); 0 = absent.
  double mscale_all_dim = 0.0;  ///< yarn; 0 = absent.
  bool truncate = true;         ///< yarn: floor/ceil the correction range.
};

/// Decoder hyper-parameters, read from a HuggingFace `config.json` (keys and
/// library defaults as in HuggingFace transformers). Three architectures
/// share the Llama block (RMSNorm, rotate_half RoPE, GQA, SwiGLU): `llama`,
/// `qwen2` (q/k/v projections with bias) and `qwen3` (per-head RMSNorm of q
/// and k before RoPE).
struct ModelConfig {
  std::string model_type = "llama";
  int hidden_size = 0;               ///< d_model.
  int intermediate_size = 0;         ///< MLP inner width.
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;       ///< GQA; defaults to num_attention_heads.
  int head_dim = 0;                  ///< defaults to hidden / heads.
  int vocab_size = 0;
  int max_position_embeddings = 2048;  ///< max context, tokens.
  float rms_norm_eps = 1e-6f;        ///< library default; Llama-2 uses 1e-5.
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;  ///< lm_head shares embed_tokens.
  int bos_token_id = 1;
  std::vector<int> eos_token_ids;    ///< `eos_token_id` (int or list).
  std::string hidden_act = "silu";
  std::string torch_dtype = "float32";
  RopeScaling rope_scaling;
  /// HF `attention_bias` for llama / qwen3: q, k, v AND o projections have
  /// biases. Qwen2 ignores the key (its q/k/v always have biases, o none).
  bool attention_bias = false;

  /// Whether q_proj / k_proj / v_proj carry biases.
  bool has_qkv_bias() const { return model_type == "qwen2" || attention_bias; }
  /// Whether o_proj carries a bias.
  bool has_o_bias() const { return model_type != "qwen2" && attention_bias; }
  /// Whether q and k get a per-head RMSNorm over head_dim before RoPE (Qwen3).
  bool has_qk_norm() const { return model_type == "qwen3"; }

  /// Query heads per KV head (GQA group size).
  int gqa_group() const { return num_attention_heads / num_key_value_heads; }
  /// Width of the fused [q; k; v] projection output.
  int qkv_dim() const {
    return (num_attention_heads + 2 * num_key_value_heads) * head_dim;
  }
};

/// Parses config.json text. Missing optional keys take the HF defaults;
/// missing required keys, a `model_type` other than llama / qwen2 / qwen3,
/// non-SiLU activation, inconsistent head counts, a `rope_scaling` type other
/// than linear / llama3 / yarn (or missing its fields; transformers >= 5's
/// `rope_parameters`, holding rope_theta too, is read alike), a sliding
/// window in
/// use, `mlp_bias`, or `partial_rotary_factor` != 1 are INVALID_ARGUMENT
/// naming the key.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);

/// Reads and parses `path` (a config.json). NOT_FOUND if absent. When a
/// generation_config.json sits next to it, its EOS ids are added
/// (ApplyGenerationConfig in generation_config.h); a malformed one is
/// INVALID_ARGUMENT naming it.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

/// Serialises `config` as HF config.json text (LlamaForCausalLM,
/// Qwen2ForCausalLM or Qwen3ForCausalLM; the keys ParseModelConfig reads,
/// `rope_scaling` included). ParseModelConfig of the result gives back
/// `config`.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_CONFIG_H_
