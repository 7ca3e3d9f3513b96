#ifndef SPECSERVE_COMMON_MODEL_CONFIG_H_
#define SPECSERVE_COMMON_MODEL_CONFIG_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace specserve {

/// Llama-architecture hyper-parameters, read from a HuggingFace `config.json`
/// (keys and library defaults as in docs REFERENCE.md section 4).
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

  /// Query heads per KV head (GQA group size).
  int gqa_group() const { return num_attention_heads / num_key_value_heads; }
  /// Width of the fused [q; k; v] projection output.
  int qkv_dim() const {
    return (num_attention_heads + 2 * num_key_value_heads) * head_dim;
  }
};

/// Parses config.json text. Missing optional keys take the HF defaults;
/// missing required keys, non-Llama `model_type`, non-SiLU activation,
/// inconsistent head counts, or an unsupported `rope_scaling` type are
/// INVALID_ARGUMENT naming the key.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);

/// Reads and parses `path` (a config.json). NOT_FOUND if absent. When a
/// generation_config.json sits next to it, its EOS ids are added
/// (ApplyGenerationConfig in generation_config.h); a malformed one is
/// INVALID_ARGUMENT naming it.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

/// Serialises `config` as HF config.json text (LlamaForCausalLM, the keys
/// ParseModelConfig reads; `rope_scaling` null). ParseModelConfig of the
/// result gives back `config`.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_CONFIG_H_
