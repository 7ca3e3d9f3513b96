#include "common/model/weights.h"

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model/safetensors.h"

namespace specserve {
namespace {

constexpr char kEmbed[] = "model.embed_tokens.weight";
constexpr char kLmHead[] = "lm_head.weight";
constexpr char kFinalNorm[] = "model.norm.weight";

std::string JoinPath(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  if (dir.back() == '/') return dir + file;
  return dir + "/" + file;
}

// Reads HF tensors into the engine layout, remembering which names it used
// so leftovers (more layers than the config says, biases) can be reported.
class Reader {
 public:
  explicit Reader(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  // Reads tensor `name` of `shape` into `*out` (resized).
  absl::Status Read(const std::string& name, std::vector<int64_t> shape,
                    std::vector<float>* out) {
    used_.insert(name);
    absl::Status s = ckpt_.ReadTensorAsFloat(name, shape, out);
    ckpt_.ReleaseTensor(name);  // converted: the mapped bytes can go
    return s;
  }

  // Reads tensor `name` of `shape` into out[offset, offset + prod(shape)).
  absl::Status ReadSlice(const std::string& name, std::vector<int64_t> shape,
                         std::vector<float>* out, size_t offset) {
    used_.insert(name);
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    absl::Status s = ckpt_.ReadTensorInto(
        name, shape, absl::MakeSpan(out->data() + offset, n));
    ckpt_.ReleaseTensor(name);
    return s;
  }

  void MarkUsed(const std::string& name) { used_.insert(name); }

  // INVALID_ARGUMENT naming the first tensor nothing read. Older HF exports
  // carry RoPE's inv_freq buffers, which are recomputed, so those are fine.
  absl::Status CheckAllUsed() const {
    for (const std::string& name : ckpt_.names()) {
      if (used_.count(name) > 0) continue;
      if (absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt_.source(), ": unexpected tensor '", name,
                       "' (not part of a model with this config.json)"));
    }
    return absl::OkStatus();
  }

 private:
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

}  // namespace

size_t ModelWeights::bytes() const {
  size_t n = embed.size() + final_norm.size() + lm_head_weight.size();
  for (const LayerWeights& l : layers) {
    n += l.attn_norm.size() + l.wqkv.size() + l.wo.size() + l.mlp_norm.size() +
         l.w_gate_up.size() + l.w_down.size() + l.bqkv.size() + l.bo.size() +
         l.q_norm.size() + l.k_norm.size();
  }
  return n * sizeof(float);
}

absl::StatusOr<ModelWeights> LoadModelWeights(const std::string& model_dir) {
  return LoadModelWeights(model_dir, LoadWeightsOptions());
}

absl::StatusOr<ModelWeights> LoadModelWeights(
    const std::string& model_dir, const LoadWeightsOptions& options) {
  absl::StatusOr<ModelConfig> config =
      LoadModelConfig(JoinPath(model_dir, "config.json"));
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt =
      Checkpoint::Open(model_dir);
  if (!ckpt.ok()) return ckpt.status();
  const Checkpoint& c = **ckpt;

  ModelWeights w;
  w.config = *config;
  const int64_t hidden = config->hidden_size;
  const int64_t ffn = config->intermediate_size;
  const int64_t vocab = config->vocab_size;
  const int64_t q_rows =
      int64_t{config->num_attention_heads} * config->head_dim;
  const int64_t kv_rows =
      int64_t{config->num_key_value_heads} * config->head_dim;
  Reader r(c);
  absl::Status s;
  const TensorInfo* probe = c.Find("model.layers.0.self_attn.q_proj.weight");
  if (probe == nullptr) probe = c.Find(kEmbed);
  if (probe == nullptr) probe = c.Find(kLmHead);
  if (probe != nullptr) w.checkpoint_dtype = probe->dtype;

  // Embeddings and output head. A tied checkpoint may keep either copy
  // (tinystories-656K stores only lm_head.weight).
  if (config->tie_word_embeddings) {
    std::string name = kEmbed;
    if (c.Find(kEmbed) == nullptr && c.Find(kLmHead) != nullptr) {
      name = kLmHead;
    } else if (c.Find(kEmbed) == nullptr) {
      return absl::NotFoundError(absl::StrCat(c.source(), ": tensor '", kEmbed,
                                              "' not found (nor '", kLmHead,
                                              "'; config.json ties them)"));
    }
    if ((s = r.Read(name, {vocab, hidden}, &w.embed)); !s.ok()) return s;
    r.MarkUsed(kLmHead);  // a redundant stored copy is ignored, as in HF
  } else {
    if ((s = r.Read(kEmbed, {vocab, hidden}, &w.embed)); !s.ok()) return s;
    if ((s = r.Read(kLmHead, {vocab, hidden}, &w.lm_head_weight)); !s.ok()) {
      if (s.code() == absl::StatusCode::kNotFound) {
        return absl::NotFoundError(absl::StrCat(
            s.message(), " (config.json has tie_word_embeddings false)"));
      }
      return s;
    }
  }

  w.layers.resize(config->num_hidden_layers);
  for (int i = 0; i < config->num_hidden_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    if ((s = r.Read(p + "input_layernorm.weight", {hidden}, &l.attn_norm));
        !s.ok()) {
      return s;
    }
    // [q; k; v] rows so one GEMM yields all three projections.
    l.wqkv.resize(static_cast<size_t>((q_rows + 2 * kv_rows) * hidden));
    if ((s = r.ReadSlice(p + "self_attn.q_proj.weight", {q_rows, hidden},
                         &l.wqkv, 0));
        !s.ok()) {
      return s;
    }
    if ((s = r.ReadSlice(p + "self_attn.k_proj.weight", {kv_rows, hidden},
                         &l.wqkv, q_rows * hidden));
        !s.ok()) {
      return s;
    }
    if ((s = r.ReadSlice(p + "self_attn.v_proj.weight", {kv_rows, hidden},
                         &l.wqkv, (q_rows + kv_rows) * hidden));
        !s.ok()) {
      return s;
    }
    if ((s = r.Read(p + "self_attn.o_proj.weight", {hidden, q_rows}, &l.wo));
        !s.ok()) {
      return s;
    }
    if (config->has_qkv_bias()) {  // same [q; k; v] order as wqkv's rows
      l.bqkv.resize(static_cast<size_t>(q_rows + 2 * kv_rows));
      if ((s = r.ReadSlice(p + "self_attn.q_proj.bias", {q_rows}, &l.bqkv,
                           0));
          !s.ok()) {
        return s;
      }
      if ((s = r.ReadSlice(p + "self_attn.k_proj.bias", {kv_rows}, &l.bqkv,
                           q_rows));
          !s.ok()) {
        return s;
      }
      if ((s = r.ReadSlice(p + "self_attn.v_proj.bias", {kv_rows}, &l.bqkv,
                           q_rows + kv_rows));
          !s.ok()) {
        return s;
      }
    }
    if (config->has_o_bias()) {
      if ((s = r.Read(p + "self_attn.o_proj.bias", {hidden}, &l.bo)); !s.ok()) {
        return s;
      }
    }
    if (config->has_qk_norm()) {
      const int64_t d = config->head_dim;
      if ((s = r.Read(p + "self_attn.q_norm.weight", {d}, &l.q_norm));
          !s.ok()) {
        return s;
      }
      if ((s = r.Read(p + "self_attn.k_norm.weight", {d}, &l.k_norm));
          !s.ok()) {
        return s;
      }
    }
    if ((s = r.Read(p + "post_attention_layernorm.weight", {hidden},
                    &l.mlp_norm));
        !s.ok()) {
      return s;
    }
    // [gate; up] rows, likewise.
    l.w_gate_up.resize(static_cast<size_t>(2 * ffn * hidden));
    if ((s = r.ReadSlice(p + "mlp.gate_proj.weight", {ffn, hidden},
                         &l.w_gate_up, 0));
        !s.ok()) {
      return s;
    }
    if ((s = r.ReadSlice(p + "mlp.up_proj.weight", {ffn, hidden}, &l.w_gate_up,
                         ffn * hidden));
        !s.ok()) {
      return s;
    }
    if ((s = r.Read(p + "mlp.down_proj.weight", {hidden, ffn}, &l.w_down));
        !s.ok()) {
      return s;
    }
    if (options.on_layer) {
      if ((s = options.on_layer(w, i, &l)); !s.ok()) return s;
    }
  }
  if ((s = r.Read(kFinalNorm, {hidden}, &w.final_norm)); !s.ok()) return s;
  if ((s = r.CheckAllUsed()); !s.ok()) return s;
  return w;
}

}  // namespace specserve
