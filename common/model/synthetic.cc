#include "common/model/synthetic.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>  // NOLINT: hardware_concurrency
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/engine/thread_pool.h"

namespace specserve {
namespace {

struct Preset {
  const char* name;
  const char* model_type;
  int hidden, ffn, layers, heads, kv_heads, head_dim, vocab, context;
  double rope_theta;
  float rms_norm_eps;
  bool tied;
  int bos, eos;
  // rope_scaling: type ("" = none), factor, llama3 low / high frequency
  // factors, original_max_position_embeddings.
  const char* rope_type;
  double rope_factor, low_freq, high_freq;
  int rope_original;
  // Standard deviation of the projections and embeddings. The tiny presets
  // use 0.2 so attention is peaked and logits spread (std ~1): with 0.02 at
  // hidden 64 attention is nearly uniform and RoPE, biases and norms would
  // barely move the logits a reference test compares.
  float init_std = 0.02f;
  bool attention_bias = false;
};

// Real-size presets: shapes from llama2.c (stories15M / stories110M, with the
// Llama-2 32000 vocab) and the published config.json of Meta's
// Llama-3.2-1B / 3B and Llama-3.1-8B and of Qwen2.5-0.5B / 7B-Instruct and
// Qwen3-0.6B / 8B (eos = the instruct models' end-of-turn token).
// Tiny presets (*-tiny): the same architecture fields at test sizes (vocab
// 512, 2 layers), one per feature the float64 reference checks; their
// rope_scaling values are the real ones except yarn (Qwen's documented
// factor 4 over a short original context so the ramp lies inside head_dim).
constexpr Preset kPresets[] = {
    {"llama2-15m", "llama", 288, 768, 6, 6, 6, 48, 32000, 2048, 10000.0, 1e-5f,
     true, 1, 2, "", 1, 1, 4, 0},
    {"llama2-110m", "llama", 768, 2048, 12, 12, 12, 64, 32000, 2048, 10000.0,
     1e-5f, true, 1, 2, "", 1, 1, 4, 0},
    {"llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 64, 128256, 131072,
     500000.0, 1e-5f, true, 128000, 128001, "llama3", 32, 1, 4, 8192},
    {"llama-3.2-3b", "llama", 3072, 8192, 28, 24, 8, 128, 128256, 131072,
     500000.0, 1e-5f, true, 128000, 128001, "llama3", 32, 1, 4, 8192},
    {"llama-3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128, 128256, 131072,
     500000.0, 1e-5f, false, 128000, 128001, "llama3", 8, 1, 4, 8192},
    {"qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, 32768,
     1000000.0, 1e-6f, true, 151643, 151645, "", 1, 1, 4, 0},
    {"qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, 32768,
     1000000.0, 1e-6f, false, 151643, 151645, "", 1, 1, 4, 0},
    {"qwen3-0.6b", "qwen3", 1024, 3072, 28, 16, 8, 128, 151936, 40960,
     1000000.0, 1e-6f, true, 151643, 151645, "", 1, 1, 4, 0},
    {"qwen3-8b", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 40960,
     1000000.0, 1e-6f, false, 151643, 151645, "", 1, 1, 4, 0},
    // A small speculator with Llama 3's full vocabulary and rope_scaling, so
    // a CPU machine can run a Llama-3-family pair with the real tokenizer
    // (llama-3.2-1b as the target; 1B + 3B do not fit 24 GiB in fp32).
    {"llama-3-draft-small", "llama", 256, 768, 2, 4, 2, 64, 128256, 131072,
     500000.0, 1e-5f, true, 128000, 128001, "llama3", 32, 1, 4, 8192},
    {"llama-tiny", "llama", 64, 128, 2, 4, 2, 16, 512, 4096, 10000.0, 1e-5f,
     true, 1, 2, "", 1, 1, 4, 0, 0.2f},
    {"llama3-tiny", "llama", 64, 128, 2, 4, 2, 32, 512, 131072, 500000.0,
     1e-5f, false, 1, 2, "llama3", 8, 1, 4, 8192, 0.2f},
    {"llama-linear-tiny", "llama", 64, 128, 2, 4, 2, 16, 512, 8192, 10000.0,
     1e-5f, true, 1, 2, "linear", 4, 1, 4, 0, 0.2f},
    {"qwen2-tiny", "qwen2", 64, 128, 2, 4, 2, 16, 512, 32768, 1000000.0, 1e-6f,
     true, 1, 2, "", 1, 1, 4, 0, 0.2f},
    {"qwen2-yarn-tiny", "qwen2", 64, 128, 2, 4, 2, 32, 512, 16384, 10000.0,
     1e-6f, false, 1, 2, "yarn", 4, 1, 4, 4096, 0.2f},
    {"qwen3-tiny", "qwen3", 64, 128, 2, 4, 2, 32, 512, 40960, 1000000.0, 1e-6f,
     true, 1, 2, "", 1, 1, 4, 0, 0.2f},
    // attention_bias: true (q/k/v and o biases), as some Llama derivatives.
    {"llama-bias-tiny", "llama", 64, 128, 2, 4, 2, 16, 512, 4096, 10000.0,
     1e-5f, true, 1, 2, "", 1, 1, 4, 0, 0.2f, true},
    // The GPU benchmark's pair (llama-3.2-1b speculator, llama-3.1-8b
    // target) at test size: their head_dim (64, 128), GQA ratio (4) and
    // rope_scaling, 2 layers, vocab 512. The emulated gpu_bench smoke test
    // runs on them.
    {"llama-3.2-1b-tiny", "llama", 128, 256, 2, 4, 1, 64, 512, 131072,
     500000.0, 1e-5f, true, 1, 2, "llama3", 32, 1, 4, 8192, 0.2f},
    {"llama-3.1-8b-tiny", "llama", 128, 256, 2, 4, 1, 128, 512, 131072,
     500000.0, 1e-5f, false, 1, 2, "llama3", 8, 1, 4, 8192, 0.2f},
};

constexpr float kInitStd = 0.02f;

uint64_t Mix64(uint64_t z) {  // SplitMix64's output function
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// Fills `out` with approximately N(0, std^2) values: element i of the stream
// is sum of the four 16-bit lanes of Mix64(key + (start + i) * golden), an
// Irwin-Hall(4) variable, centred and scaled. Counter-based, so any chunking
// gives the same stream.
void FillNormal(uint64_t key, uint64_t start, float std, float* out, size_t n) {
  // Each lane is uniform on {0..65535}: variance (65536^2 - 1) / 12, so the
  // sum of four has standard deviation ~65536 / sqrt(3).
  const float scale = std * std::sqrt(3.0f) / 65536.0f;
  const float centre = 2.0f * 65535.0f;
  uint64_t state = key + start * kGolden;
  for (size_t i = 0; i < n; ++i) {
    state += kGolden;
    const uint64_t r = Mix64(state);
    const uint32_t s = static_cast<uint32_t>(r & 0xffff) +
                       static_cast<uint32_t>((r >> 16) & 0xffff) +
                       static_cast<uint32_t>((r >> 32) & 0xffff) +
                       static_cast<uint32_t>(r >> 48);
    out[i] = (static_cast<float>(s) - centre) * scale;
  }
}

struct SyntheticTensor {
  TensorSpec spec;
  float mean;  // 1 for norm weights, else 0
  float std;   // 0 for the model's RMSNorm weights (all ones)
};

// Biases and q/k norm weights are spread wider than 0.02 so a reference
// comparison notices one applied wrongly.
constexpr float kBiasStd = 0.1f;

std::vector<SyntheticTensor> TensorsOf(const ModelConfig& c, DType dtype,
                                       float init_std) {
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size;
  const int64_t q = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_key_value_heads} * c.head_dim;
  std::vector<SyntheticTensor> ts;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool ones) {
    ts.push_back({{std::move(name), std::move(shape), dtype},
                  ones ? 1.0f : 0.0f, ones ? 0.0f : init_std});
  };
  auto add_spread = [&](std::string name, std::vector<int64_t> shape,
                        float mean) {
    ts.push_back({{std::move(name), std::move(shape), dtype}, mean, kBiasStd});
  };
  add("model.embed_tokens.weight", {v, h}, false);
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h}, true);
    add(p + "self_attn.q_proj.weight", {q, h}, false);
    add(p + "self_attn.k_proj.weight", {kv, h}, false);
    add(p + "self_attn.v_proj.weight", {kv, h}, false);
    add(p + "self_attn.o_proj.weight", {h, q}, false);
    if (c.has_qkv_bias()) {
      add_spread(p + "self_attn.q_proj.bias", {q}, 0.0f);
      add_spread(p + "self_attn.k_proj.bias", {kv}, 0.0f);
      add_spread(p + "self_attn.v_proj.bias", {kv}, 0.0f);
    }
    if (c.has_o_bias()) add_spread(p + "self_attn.o_proj.bias", {h}, 0.0f);
    if (c.has_qk_norm()) {
      add_spread(p + "self_attn.q_norm.weight", {c.head_dim}, 1.0f);
      add_spread(p + "self_attn.k_norm.weight", {c.head_dim}, 1.0f);
    }
    add(p + "post_attention_layernorm.weight", {h}, true);
    add(p + "mlp.gate_proj.weight", {f, h}, false);
    add(p + "mlp.up_proj.weight", {f, h}, false);
    add(p + "mlp.down_proj.weight", {h, f}, false);
  }
  add("model.norm.weight", {h}, true);
  if (!c.tie_word_embeddings) add("lm_head.weight", {v, h}, false);
  return ts;
}

absl::Status MakeDirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat(
          prefix, ": cannot create directory: ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InternalError(absl::StrCat(dir, ": not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) {
    return absl::InternalError(absl::StrCat(path, ": write failed"));
  }
  return absl::OkStatus();
}

const char* TorchDType(DType d) {
  switch (d) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "float32";
  }
}

absl::Status WriteImpl(const ModelConfig& config, const std::string& dir,
                       uint64_t seed, DType dtype, float init_std,
                       const std::map<std::string, std::string>& metadata) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic checkpoints are F32, BF16 or F16, not ",
                     std::string(DTypeName(dtype))));
  }
  // Refuse configs the loader would refuse, before writing GBs.
  ModelConfig c = config;
  c.torch_dtype = TorchDType(dtype);
  const std::string config_json = ModelConfigToJson(c);
  absl::StatusOr<ModelConfig> check = ParseModelConfig(config_json);
  if (!check.ok()) return check.status();

  absl::Status s = MakeDirs(dir);
  if (!s.ok()) return s;
  const std::string final_path = dir + "/model.safetensors";
  const std::string tmp_path = final_path + ".tmp";
  std::vector<SyntheticTensor> tensors = TensorsOf(c, dtype, init_std);
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const SyntheticTensor& t : tensors) specs.push_back(t.spec);
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(tmp_path, specs, metadata);
  if (!w.ok()) return w.status();

  // Counter-based streams make every chunk independent of the others: the
  // chunks are drawn and written by all cores at once (pwrite at their
  // offsets), and the bytes are the same whatever the thread count.
  constexpr uint64_t kChunk = uint64_t{1} << 20;  // elements
  struct Chunk {
    size_t tensor;
    uint64_t first, count;
  };
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    uint64_t n = 1;
    for (int64_t d : tensors[t].spec.shape) n *= static_cast<uint64_t>(d);
    for (uint64_t first = 0; first < n; first += kChunk) {
      chunks.push_back({t, first, std::min(kChunk, n - first)});
    }
  }
  // One status per chunk: workers never share one.
  std::vector<absl::Status> status(chunks.size());
  ThreadPool pool(static_cast<int>(std::clamp<size_t>(
      std::thread::hardware_concurrency(), 1,
      std::max<size_t>(1, chunks.size()))));
  pool.ParallelFor(
      static_cast<int>(chunks.size()), 1, [&](int begin, int end) {
        std::vector<float> buf(kChunk);
        for (int i = begin; i < end; ++i) {
          const Chunk& c = chunks[i];
          const SyntheticTensor& t = tensors[c.tensor];
          const size_t m = static_cast<size_t>(c.count);
          if (t.std == 0.0f) {
            std::fill(buf.begin(), buf.begin() + m, t.mean);
          } else {
            FillNormal(Mix64(seed ^ Mix64(c.tensor + 1)), c.first, t.std,
                       buf.data(), m);
            for (size_t j = 0; j < m; ++j) buf[j] += t.mean;
          }
          status[i] = (*w)->WriteAt(c.tensor, static_cast<int64_t>(c.first),
                                    absl::MakeConstSpan(buf.data(), m));
        }
      });
  for (const absl::Status& st : status) {
    if (!st.ok()) return st;
  }
  if ((s = (*w)->Finish()); !s.ok()) return s;
  if (std::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(
        final_path, ": cannot rename from .tmp: ", std::strerror(errno)));
  }
  return WriteFile(dir + "/config.json", config_json + "\n");
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig c;
    c.model_type = p.model_type;
    c.hidden_size = p.hidden;
    c.intermediate_size = p.ffn;
    c.num_hidden_layers = p.layers;
    c.num_attention_heads = p.heads;
    c.num_key_value_heads = p.kv_heads;
    c.head_dim = p.head_dim;
    c.vocab_size = p.vocab;
    c.max_position_embeddings = p.context;
    c.rms_norm_eps = p.rms_norm_eps;
    c.rope_theta = p.rope_theta;
    c.tie_word_embeddings = p.tied;
    c.bos_token_id = p.bos;
    c.eos_token_ids = {p.eos};
    c.hidden_act = "silu";
    c.torch_dtype = "float32";
    c.attention_bias = p.attention_bias;
    c.rope_scaling.type = p.rope_type;
    if (!c.rope_scaling.type.empty()) {
      c.rope_scaling.factor = p.rope_factor;
      c.rope_scaling.original_max_position_embeddings = p.rope_original;
    }
    if (c.rope_scaling.type == "llama3") {
      c.rope_scaling.low_freq_factor = p.low_freq;
      c.rope_scaling.high_freq_factor = p.high_freq;
    }
    return c;
  }
  return absl::NotFoundError(
      absl::StrCat("unknown synthetic preset '", name,
                   "'; known: ", absl::StrJoin(PresetNames(), ", ")));
}

int64_t CountParameters(const ModelConfig& c) {
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size;
  const int64_t q = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_key_value_heads} * c.head_dim;
  const int64_t per_layer = 2 * h + (q + 2 * kv) * h + h * q + 3 * f * h +
                            (c.has_qkv_bias() ? q + 2 * kv : 0) +
                            (c.has_o_bias() ? h : 0) +
                            (c.has_qk_norm() ? 2 * c.head_dim : 0);
  return v * h * (c.tie_word_embeddings ? 1 : 2) +
         c.num_hidden_layers * per_layer + h;
}

absl::Status WriteSyntheticCheckpointForConfig(const ModelConfig& config,
                                               const std::string& dir,
                                               uint64_t seed, DType dtype) {
  return WriteImpl(config, dir, seed, dtype, kInitStd,
                   {{"format", "pt"},
                    {"specserve_synthetic", "random weights"},
                    {"seed", absl::StrCat(seed)}});
}

absl::Status WriteSyntheticCheckpoint(const std::string& preset,
                                      const std::string& dir, uint64_t seed,
                                      std::string dtype) {
  absl::StatusOr<ModelConfig> config = PresetConfig(preset);
  if (!config.ok()) return config.status();
  absl::StatusOr<DType> d = ParseDType(dtype);
  if (!d.ok() ||
      (*d != DType::kF32 && *d != DType::kBF16 && *d != DType::kF16)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic checkpoint dtype '", dtype, "' is not F32, BF16 or F16"));
  }
  float init_std = kInitStd;
  for (const Preset& p : kPresets) {
    if (preset == p.name) init_std = p.init_std;
  }
  return WriteImpl(*config, dir, seed, *d, init_std,
                   {{"format", "pt"},
                    {"specserve_synthetic", preset},
                    {"seed", absl::StrCat(seed)}});
}

}  // namespace specserve
