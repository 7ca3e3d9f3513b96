#include "common/model/config.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model/generation_config.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;

// Largest value accepted for a size-like key. Keeps every product the engine
// forms from two of them (e.g. vocab * hidden) far from int64 overflow and
// products of a count and head_dim inside int.
constexpr int64_t kMaxDim = int64_t{1} << 24;

// Reads an optional integer key into `out`; null counts as absent. Floats,
// strings and out-of-range values are INVALID_ARGUMENT naming the key.
absl::Status ReadInt(const Json& j, const char* key, bool required, int* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: missing required key '", key, "'"));
    }
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) {  // true for signed and unsigned
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' must be an integer, got ", it->dump()));
  }
  int64_t v;
  if (it->is_number_unsigned()) {
    uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: '", key, "' = ", u, " is out of range"));
    }
    v = static_cast<int64_t>(u);
  } else {
    v = it->get<int64_t>();
  }
  if (v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: '", key, "' = ", v, " is out of range"));
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status ReadDouble(const Json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' must be a number, got ", it->dump()));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status ReadString(const Json& j, const char* key, std::string* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' must be a string, got ", it->dump()));
  }
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status RequirePositive(const char* key, int64_t v) {
  if (v <= 0 || v > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' = ", v, " must be in [1, ", kMaxDim, "]"));
  }
  return absl::OkStatus();
}

// `eos_token_id` is an int or a list of ints (Llama-3 instruct models list
// several stop tokens). Absent/null keeps the default {2}.
absl::Status ReadEos(const Json& j, std::vector<int>* out) {
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  auto one = [](const Json& v, int* id) -> bool {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
        return false;
      }
      *id = static_cast<int>(u);
      return true;
    }
    int64_t s = v.get<int64_t>();
    if (s < 0 || s > std::numeric_limits<int>::max()) return false;
    *id = static_cast<int>(s);
    return true;
  };
  std::vector<int> ids;
  if (it->is_array()) {
    for (const Json& v : *it) {
      int id;
      if (!one(v, &id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config.json: 'eos_token_id' entries must be non-negative "
            "integers, got ",
            it->dump()));
      }
      ids.push_back(id);
    }
    if (ids.empty()) {
      return absl::InvalidArgumentError(
          "config.json: 'eos_token_id' is an empty list");
    }
  } else {
    int id;
    if (!one(*it, &id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: 'eos_token_id' must be a non-negative integer or a "
          "list of them, got ",
          it->dump()));
    }
    ids.push_back(id);
  }
  *out = std::move(ids);
  return absl::OkStatus();
}

// Reads an optional boolean key; null counts as absent.
absl::Status ReadBool(const Json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' must be a boolean, got ", it->dump()));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

// Reads the RoPE scaling object under `key`: `rope_scaling`
// (transformers' modeling_rope_utils: the type under "rope_type" or the
// legacy "type"), or `rope_parameters` (transformers >= 5, which also holds
// rope_theta). Required fields per type as HF validates them; values that
// would divide by zero or are not finite are INVALID_ARGUMENT naming
// <key>.<field>.
absl::Status ReadRopeScaling(const Json& j, const char* key,
                             RopeScaling* out) {
  auto rs = j.find(key);
  if (rs == j.end() || rs->is_null()) return absl::OkStatus();
  if (!rs->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, "' must be an object or null, got ",
        rs->dump()));
  }
  RopeScaling r;
  absl::Status s;
  for (const char* key : {"type", "rope_type"}) {  // rope_type wins
    if ((s = ReadString(*rs, key, &r.type)); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.message(), " (in ", key, ")"));
    }
  }
  if (r.type == "default") r.type.clear();
  if (r.type.empty()) {
    *out = r;
    return absl::OkStatus();
  }
  if (r.type != "linear" && r.type != "llama3" && r.type != "yarn") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: ", key, " type '", r.type,
        "' is not supported (only 'linear', 'llama3' and 'yarn')"));
  }
  // A number field of rope_scaling; `required` ones must be present.
  auto num = [&](const char* field, bool required,
                 double* v) -> absl::Status {
    auto it = rs->find(field);
    if (it == rs->end() || it->is_null()) {
      if (!required) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", key, " type '", r.type,
                       "' requires '", key, ".", field, "'"));
    }
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: '", key, ".", field,
                       "' must be a finite number, got ", it->dump()));
    }
    *v = it->get<double>();
    return absl::OkStatus();
  };
  if ((s = num("factor", true, &r.factor)); !s.ok()) return s;
  if (!(r.factor > 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: '", key, ".factor' = ", r.factor,
        " must be positive"));
  }
  double orig = 0.0;
  if ((s = num("original_max_position_embeddings", r.type == "llama3",
               &orig));
      !s.ok()) {
    return s;
  }
  if (orig != 0.0 || r.type == "llama3") {
    if (!(orig >= 1.0 && orig <= kMaxDim && orig == std::floor(orig))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: '", key, ".original_max_position_embeddings' = ",
          orig, " must be an integer in [1, ", kMaxDim, "]"));
    }
    r.original_max_position_embeddings = static_cast<int>(orig);
  }
  if (r.type == "llama3") {
    if ((s = num("low_freq_factor", true, &r.low_freq_factor)); !s.ok()) {
      return s;
    }
    if ((s = num("high_freq_factor", true, &r.high_freq_factor)); !s.ok()) {
      return s;
    }
    if (!(r.low_freq_factor > 0.0 &&
          r.high_freq_factor > r.low_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: '", key, ".high_freq_factor' (", r.high_freq_factor,
          ") must exceed '", key, ".low_freq_factor' (", r.low_freq_factor,
          ") > 0"));
    }
  }
  if (r.type == "yarn") {
    if ((s = num("beta_fast", false, &r.beta_fast)); !s.ok()) return s;
    if ((s = num("beta_slow", false, &r.beta_slow)); !s.ok()) return s;
    if ((s = num("attention_factor", false, &r.attention_factor)); !s.ok()) {
      return s;
    }
    if ((s = num("mscale", false, &r.mscale)); !s.ok()) return s;
    if ((s = num("mscale_all_dim", false, &r.mscale_all_dim)); !s.ok()) {
      return s;
    }
    if ((s = ReadBool(*rs, "truncate", &r.truncate)); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.message(), " (in ", key, ")"));
    }
    if (!(r.beta_fast > 0.0 && r.beta_slow > 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: '", key, ".beta_fast' and '", key,
                       ".beta_slow' must be positive"));
    }
    if (r.attention_factor < 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: '", key, ".attention_factor' must be positive"));
    }
    // 0.1 * mscale * ln(factor) + 1 must stay positive: HF's values are 0
    // (absent) or around 1.
    if (r.mscale < 0.0 || r.mscale_all_dim < 0.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: '", key, ".mscale' and '", key,
                       ".mscale_all_dim' must be non-negative"));
    }
  }
  *out = r;
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseJson(const Json& j) {
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        "config.json: top level must be a JSON object");
  }
  ModelConfig c;
  c.eos_token_ids = {2};

  // Architecture: the Llama block, plus Qwen2's q/k/v biases and Qwen3's
  // q/k norms.
  absl::Status s = ReadString(j, "model_type", &c.model_type);
  if (!s.ok()) return s;
  if (c.model_type != "llama" && c.model_type != "qwen2" &&
      c.model_type != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: model_type '", c.model_type,
        "' is not supported (only 'llama', 'qwen2' and 'qwen3')"));
  }
  if ((s = ReadString(j, "hidden_act", &c.hidden_act)); !s.ok()) return s;
  if (c.hidden_act != "silu") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: hidden_act '", c.hidden_act,
                     "' is not supported (only 'silu')"));
  }
  if ((s = ReadBool(j, "attention_bias", &c.attention_bias)); !s.ok()) {
    return s;
  }
  if (c.model_type == "qwen2") c.attention_bias = false;  // not a Qwen2 key
  bool flag = false;
  if ((s = ReadBool(j, "mlp_bias", &flag)); !s.ok()) return s;
  if (flag) {
    return absl::InvalidArgumentError(
        "config.json: 'mlp_bias' = true is not supported");
  }
  // Qwen's sliding-window attention is off unless use_sliding_window is set
  // (its `sliding_window` size is then unused).
  flag = false;
  if ((s = ReadBool(j, "use_sliding_window", &flag)); !s.ok()) return s;
  if (flag) {
    return absl::InvalidArgumentError(
        "config.json: 'use_sliding_window' = true is not supported (full "
        "causal attention only)");
  }
  double partial = 1.0;
  if ((s = ReadDouble(j, "partial_rotary_factor", &partial)); !s.ok()) {
    return s;
  }
  if (partial != 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: 'partial_rotary_factor' = ", partial,
        " is not supported (only 1)"));
  }

  // Shapes.
  if ((s = ReadInt(j, "hidden_size", true, &c.hidden_size)); !s.ok()) {
    return s;
  }
  if ((s = ReadInt(j, "intermediate_size", true, &c.intermediate_size));
      !s.ok()) {
    return s;
  }
  if ((s = ReadInt(j, "num_hidden_layers", true, &c.num_hidden_layers));
      !s.ok()) {
    return s;
  }
  if ((s = ReadInt(j, "num_attention_heads", true, &c.num_attention_heads));
      !s.ok()) {
    return s;
  }
  if ((s = ReadInt(j, "vocab_size", true, &c.vocab_size)); !s.ok()) return s;
  c.num_key_value_heads = c.num_attention_heads;
  if ((s = ReadInt(j, "num_key_value_heads", false, &c.num_key_value_heads));
      !s.ok()) {
    return s;
  }
  if ((s = ReadInt(j, "head_dim", false, &c.head_dim)); !s.ok()) return s;
  if ((s = ReadInt(j, "max_position_embeddings", false,
                   &c.max_position_embeddings));
      !s.ok()) {
    return s;
  }
  for (auto [key, v] :
       {std::pair<const char*, int>{"hidden_size", c.hidden_size},
        {"intermediate_size", c.intermediate_size},
        {"num_hidden_layers", c.num_hidden_layers},
        {"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.num_key_value_heads},
        {"vocab_size", c.vocab_size},
        {"max_position_embeddings", c.max_position_embeddings}}) {
    if ((s = RequirePositive(key, v)); !s.ok()) return s;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: num_attention_heads (", c.num_attention_heads,
        ") must be a multiple of num_key_value_heads (", c.num_key_value_heads,
        ")"));
  }
  auto hd = j.find("head_dim");
  if (hd == j.end() || hd->is_null()) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: hidden_size (", c.hidden_size,
                       ") is not divisible by num_attention_heads (",
                       c.num_attention_heads, ") and head_dim is not given"));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if ((s = RequirePositive("head_dim", c.head_dim)); !s.ok()) return s;
  // rotate_half RoPE pairs dimension i with i + head_dim / 2.
  if (c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: head_dim (", c.head_dim, ") must be even for RoPE"));
  }
  const int64_t qkv =
      (int64_t{c.num_attention_heads} + 2 * int64_t{c.num_key_value_heads}) *
      c.head_dim;
  if (qkv > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: (num_attention_heads + 2 * num_key_value_heads) * "
        "head_dim = ",
        qkv, " exceeds ", kMaxDim));
  }

  // Numerics.
  double eps = 1e-6;
  if ((s = ReadDouble(j, "rms_norm_eps", &eps)); !s.ok()) return s;
  if (!(eps > 0.0 && eps < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: rms_norm_eps = ", eps, " must be in (0, 1)"));
  }
  c.rms_norm_eps = static_cast<float>(eps);
  if ((s = ReadDouble(j, "rope_theta", &c.rope_theta)); !s.ok()) return s;
  // transformers >= 5 saves rope_theta and the scaling together under
  // rope_parameters; older files use rope_theta + rope_scaling.
  const char* rope_key = "rope_scaling";
  auto rp = j.find("rope_parameters");
  if (rp != j.end() && !rp->is_null()) {
    auto rs = j.find("rope_scaling");
    if (rs != j.end() && !rs->is_null()) {
      return absl::InvalidArgumentError(
          "config.json: both 'rope_scaling' and 'rope_parameters' are given");
    }
    rope_key = "rope_parameters";
    if (rp->is_object()) {
      if ((s = ReadDouble(*rp, "rope_theta", &c.rope_theta)); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(s.message(), " (in rope_parameters)"));
      }
    }
  }
  if (!(c.rope_theta > 0.0 && std::isfinite(c.rope_theta))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: rope_theta = ", c.rope_theta, " must be positive"));
  }
  if ((s = ReadRopeScaling(j, rope_key, &c.rope_scaling)); !s.ok()) return s;
  // YaRN's correction range divides by ln(rope_theta).
  if (c.rope_scaling.type == "yarn" && !(c.rope_theta > 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: rope_theta = ", c.rope_theta,
        " must exceed 1 for rope_scaling type 'yarn'"));
  }
  auto tie = j.find("tie_word_embeddings");
  if (tie != j.end() && !tie->is_null()) {
    if (!tie->is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: 'tie_word_embeddings' must be a boolean, got ",
          tie->dump()));
    }
    c.tie_word_embeddings = tie->get<bool>();
  }

  // Special tokens.
  if ((s = ReadInt(j, "bos_token_id", false, &c.bos_token_id)); !s.ok()) {
    return s;
  }
  if (c.bos_token_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: bos_token_id = ", c.bos_token_id, " is negative"));
  }
  if ((s = ReadEos(j, &c.eos_token_ids)); !s.ok()) return s;
  if ((s = ReadString(j, "torch_dtype", &c.torch_dtype)); !s.ok()) return s;
  return c;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text) {
  Json j = Json::parse(json_text.begin(), json_text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError("config.json: not valid JSON");
  }
  // get<> on checked types does not throw, but keep exceptions from ever
  // crossing the module boundary.
  try {
    return ParseJson(j);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", e.what()));
  }
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(path, ": not found"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  absl::StatusOr<ModelConfig> c = ParseModelConfig(buf.str());
  if (!c.ok()) {
    return absl::Status(c.status().code(),
                        absl::StrCat(path, ": ", c.status().message()));
  }
  // EOS ids from a sibling generation_config.json join config.json's.
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : path.substr(0, slash);
  if (absl::Status s = ApplyGenerationConfigFile(dir, &*c); !s.ok()) return s;
  return c;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  const char* arch = c.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                     : c.model_type == "qwen3" ? "Qwen3ForCausalLM"
                                               : "LlamaForCausalLM";
  j["architectures"] = {arch};
  j["model_type"] = c.model_type;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  // Print the float eps through double so 1e-5f reads back as 1e-5f.
  j["rms_norm_eps"] = std::stod(absl::StrCat(c.rms_norm_eps));
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  if (r.type.empty()) {
    j["rope_scaling"] = nullptr;
  } else {
    nlohmann::ordered_json rs;
    rs["rope_type"] = r.type;
    rs["factor"] = r.factor;
    if (r.type == "llama3") {
      rs["low_freq_factor"] = r.low_freq_factor;
      rs["high_freq_factor"] = r.high_freq_factor;
    }
    if (r.original_max_position_embeddings > 0) {
      rs["original_max_position_embeddings"] =
          r.original_max_position_embeddings;
    }
    if (r.type == "yarn") {
      rs["beta_fast"] = r.beta_fast;
      rs["beta_slow"] = r.beta_slow;
      if (r.attention_factor > 0) rs["attention_factor"] = r.attention_factor;
      if (r.mscale != 0) rs["mscale"] = r.mscale;
      if (r.mscale_all_dim != 0) rs["mscale_all_dim"] = r.mscale_all_dim;
      rs["truncate"] = r.truncate;
    }
    j["rope_scaling"] = rs;
  }
  j["hidden_act"] = c.hidden_act;
  if (c.model_type == "qwen2") {
    j["use_sliding_window"] = false;
  } else {
    j["attention_bias"] = c.attention_bias;
  }
  if (c.model_type == "llama") j["mlp_bias"] = false;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  }
  j["torch_dtype"] = c.torch_dtype;
  return j.dump(2);
}

}  // namespace specserve
