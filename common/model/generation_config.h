#ifndef SPECSERVE_COMMON_MODEL_GENERATION_CONFIG_H_
#define SPECSERVE_COMMON_MODEL_GENERATION_CONFIG_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "common/model/config.h"

namespace specserve {

/// Adds the EOS ids of a HuggingFace `generation_config.json` (text in
/// `json_text`) to `config->eos_token_ids`. `eos_token_id` may be an int or
/// a list of ints (Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|>,
/// <|eot_id|>; Qwen 2.5 Instruct lists <|im_end|>, <|endoftext|>); absent or
/// null adds nothing. Ids already present are not repeated and config.json's
/// come first: generation stops at any of them, as transformers' generate
/// (which reads generation_config.json) and vLLM (which adds its ids to the
/// stop set) both do. Other keys are ignored. INVALID_ARGUMENT, naming
/// generation_config.json, for invalid JSON or an id that is not a
/// non-negative int.
absl::Status ApplyGenerationConfig(std::string_view json_text,
                                   ModelConfig* config);

/// ApplyGenerationConfig on `model_dir`/generation_config.json when that
/// file exists (OK and `config` unchanged when it does not); errors name the
/// path.
absl::Status ApplyGenerationConfigFile(const std::string& model_dir,
                                       ModelConfig* config);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_GENERATION_CONFIG_H_
