#include "common/model/weights.h"

#include <algorithm>

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

  // Tensor `name` of `shape` in place (checked as Read checks it); its
  // pages are released by Release().
  absl::StatusOr<RawTensor> View(const std::string& name,
                                 std::vector<int64_t> shape) {
    used_.insert(name);
    viewed_.push_back(name);
    return ckpt_.ViewTensor(name, shape);
  }

  // Appends tensor `name` [rows, view->cols] to `view`'s blocks.
  absl::Status ViewInto(const std::string& name, int64_t rows,
                        LinearView* view) {
    absl::StatusOr<RawTensor> t = View(name, {rows, view->cols});
    if (!t.ok()) return t.status();
    view->blocks.push_back(*t);
    return absl::OkStatus();
  }

  // Reads the Linear tensors `parts` ((name, rows), each [rows, cols]) as
  // one matrix, stacked top to bottom: as views appended to `view` when
  // `as_view`, else converted to f32 into `dst` (resized).
  absl::Status Linear(
      const std::vector<std::pair<std::string, int64_t>>& parts,
      int64_t cols, bool as_view, LinearView* view, std::vector<float>* dst) {
    if (as_view) {
      view->cols = cols;
      for (const auto& [name, rows] : parts) {
        if (absl::Status s = ViewInto(name, rows, view); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    int64_t total = 0;
    for (const auto& part : parts) total += part.second;
    dst->resize(static_cast<size_t>(total * cols));
    int64_t at = 0;
    for (const auto& [name, rows] : parts) {
      if (absl::Status s = ReadSlice(name, {rows, cols}, dst, at * cols);
          !s.ok()) {
        return s;
      }
      at += rows;
    }
    return absl::OkStatus();
  }

  // Drops the mapped pages of every tensor View returned so far.
  void Release() {
    for (const std::string& name : viewed_) ckpt_.ReleaseTensor(name);
    viewed_.clear();
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
  std::vector<std::string> viewed_;
};

}  // namespace

int64_t LinearView::rows() const {
  int64_t n = 0;
  for (const RawTensor& b : blocks) {
    n += static_cast<int64_t>(b.bytes.size() / DTypeSize(b.dtype)) / cols;
  }
  return n;
}

void LinearView::RowsToFloat(int64_t begin, int64_t end, float* dst) const {
  int64_t first = 0;  // first row of the current block
  for (const RawTensor& b : blocks) {
    const size_t es = DTypeSize(b.dtype);
    const int64_t n = static_cast<int64_t>(b.bytes.size() / es) / cols;
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + n);
    if (lo < hi) {
      ConvertToFloat(b.bytes.data() + static_cast<size_t>(lo - first) * cols * es,
                     b.dtype, static_cast<size_t>(hi - lo) * cols,
                     dst + static_cast<size_t>(lo - begin) * cols);
    }
    first += n;
  }
}

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
  const bool tied = config->tie_word_embeddings;
  std::string embed_name = kEmbed;
  if (tied && c.Find(kEmbed) == nullptr) {
    if (c.Find(kLmHead) == nullptr) {
      return absl::NotFoundError(absl::StrCat(c.source(), ": tensor '", kEmbed,
                                              "' not found (nor '", kLmHead,
                                              "'; config.json ties them)"));
    }
    embed_name = kLmHead;
  }
  const bool embed_views = static_cast<bool>(options.on_embeddings);
  LinearView embed_view, head_view;
  if ((s = r.Linear({{embed_name, vocab}}, hidden, embed_views, &embed_view,
                    &w.embed));
      !s.ok()) {
    return s;
  }
  if (tied) {
    r.MarkUsed(kLmHead);  // a redundant stored copy is ignored, as in HF
  } else if ((s = r.Linear({{kLmHead, vocab}}, hidden, embed_views,
                           &head_view, &w.lm_head_weight));
             !s.ok()) {
    if (s.code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(absl::StrCat(
          s.message(), " (config.json has tie_word_embeddings false)"));
    }
    return s;
  }
  if (embed_views) {
    if ((s = options.on_embeddings(w, embed_view, tied ? nullptr : &head_view));
        !s.ok()) {
      return s;
    }
    r.Release();
  }

  const bool use_views = static_cast<bool>(options.on_linear_layer);
  w.layers.resize(config->num_hidden_layers);
  for (int i = 0; i < config->num_hidden_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    if ((s = r.Read(p + "input_layernorm.weight", {hidden}, &l.attn_norm));
        !s.ok()) {
      return s;
    }
    // [q; k; v] rows so one GEMM yields all three projections.
    LayerLinearViews views;
    if ((s = r.Linear({{p + "self_attn.q_proj.weight", q_rows},
                       {p + "self_attn.k_proj.weight", kv_rows},
                       {p + "self_attn.v_proj.weight", kv_rows}},
                      hidden, use_views, &views.wqkv, &l.wqkv));
        !s.ok()) {
      return s;
    }
    if ((s = r.Linear({{p + "self_attn.o_proj.weight", hidden}}, q_rows,
                      use_views, &views.wo, &l.wo));
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
    if ((s = r.Linear({{p + "mlp.gate_proj.weight", ffn},
                       {p + "mlp.up_proj.weight", ffn}},
                      hidden, use_views, &views.w_gate_up, &l.w_gate_up));
        !s.ok()) {
      return s;
    }
    if ((s = r.Linear({{p + "mlp.down_proj.weight", hidden}}, ffn, use_views,
                      &views.w_down, &l.w_down));
        !s.ok()) {
      return s;
    }
    if (options.on_layer) {
      if ((s = options.on_layer(w, i, &l)); !s.ok()) return s;
    }
    if (use_views) {
      if ((s = options.on_linear_layer(w, i, views)); !s.ok()) return s;
      r.Release();
    }
  }
  if ((s = r.Read(kFinalNorm, {hidden}, &w.final_norm)); !s.ok()) return s;
  if ((s = r.CheckAllUsed()); !s.ok()) return s;
  return w;
}

}  // namespace specserve
