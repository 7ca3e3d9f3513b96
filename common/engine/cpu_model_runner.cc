#include "common/engine/cpu_model_runner.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/engine/huge_page_arena.h"
#include "common/engine/kernels.h"
#include "common/engine/small_head_attention.h"
#include "common/engine/thread_pool.h"

namespace specserve {
namespace {

// Up to this many rows (decode and verify rows, batched or not), Linear
// streams the packed weights once for all rows with kernels::PanelGemm;
// beyond it OpenBLAS sgemm is compute-bound and wins.
constexpr int kMaxGemvRows = 64;
// Sequences with up to this many new rows (decode, verify) attend with
// kernels::AttentionRows straight from their blocks; longer prefill chunks
// use GEMMs over a dense copy of K / V. AttentionRows vectorises over
// head_dim and reduces each dot product across lanes; below 32 dims that
// wastes most of every vector, and from 2 rows on the GEMMs win (verify of
// 5 / 16 rows on stories260K, head_dim 8: 0.61 -> 0.18 ms and 2.20 ->
// 0.45 ms; bench/target_bench).
constexpr int kMaxDirectAttentionRows = 16;
constexpr int kMaxDirectAttentionRowsSmallHead = 1;
constexpr int kSmallHeadDim = 32;
// 8- and 16-dim heads on AVX-512 (kernels::AttentionRowsSmallHead) take
// every row straight from the blocks: on stories260K at 350-414 cached
// tokens (bench/draft_tree_bench, 1 thread) a decode step 70 -> 46-54 us
// against the previous kernel, a 17-row tree verify 397-474 us with the
// GEMMs -> 330-376 us, and a 432-token prefill 14 -> 8.5-10 ms against
// the GEMMs on 2 threads (bench/target_bench; tinystories-656K at parity).
// Below this many multiply-adds a Linear runs on the calling thread.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;
// Caps the attention score block at ~16M floats (64 MiB) per call.
constexpr size_t kMaxScoreFloats = size_t{1} << 24;
// Target rows (query tokens x heads of a GQA group) per score GEMM.
constexpr int kTargetGemmRows = 256;

void FreeVector(std::vector<float>* v) { std::vector<float>().swap(*v); }

// The f32 parameters the runner keeps once the Linear weights are packed.
ModelWeights SmallParameters(const ModelWeights& w) {
  ModelWeights s;
  s.config = w.config;
  s.checkpoint_dtype = w.checkpoint_dtype;
  s.final_norm = w.final_norm;
  s.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& a = w.layers[l];
    LayerWeights& d = s.layers[l];
    d.attn_norm = a.attn_norm;
    d.mlp_norm = a.mlp_norm;
    d.bqkv = a.bqkv;
    d.bo = a.bo;
    d.q_norm = a.q_norm;
    d.k_norm = a.k_norm;
  }
  return s;
}

// Host-side query capture: per layer [max_rows, heads, head_dim] fp32.
class CpuQueryCapture : public QueryCapture {
 public:
  CpuQueryCapture(const ModelConfig& c, int max_rows)
      : max_rows_(max_rows),
        row_(static_cast<size_t>(c.num_attention_heads) * c.head_dim),
        layers_(c.num_hidden_layers) {
    for (auto& l : layers_) l.resize(max_rows * row_);
  }
  int rows() const override { return rows_; }
  int max_rows() const override { return max_rows_; }
  void Clear() override { rows_ = 0; }
  absl::StatusOr<std::vector<float>> CopyToHost() const override {
    std::vector<float> out;
    out.reserve(layers_.size() * rows_ * row_);
    for (const auto& l : layers_) {
      out.insert(out.end(), l.begin(), l.begin() + rows_ * row_);
    }
    return out;
  }
  float* row(int layer, int r) { return &layers_[layer][r * row_]; }
  const float* layer(int l) const { return layers_[l].data(); }

  int rows_ = 0;

 private:
  int max_rows_;
  size_t row_;
  std::vector<std::vector<float>> layers_;
};

}  // namespace

struct CpuModelRunner::Scratch {
  std::vector<float> qg, og, scores;  // attention blocks
  std::vector<float> k_dense, v_dense;  // gathered K/V of a sequence
};

// One thread's activation buffers across forwards (see Forward).
struct CpuModelRunner::ActivationBuffers {
  // Buffer `i` resized to `n` floats (contents unspecified).
  std::vector<float>& Get(int i, size_t n) {
    buf[i].resize(n);
    return buf[i];
  }
  std::vector<float> buf[8];
  Scratch scratch;
  PackedMatrix::Input input;  // the Linear inputs, converted
};

std::string KvCacheDTypeName(KvCacheDType t) {
  return t == KvCacheDType::kBF16 ? "bf16" : "f32";
}

absl::StatusOr<std::optional<KvCacheDType>> ParseKvCacheDType(
    const std::string& s) {
  const std::string v = absl::AsciiStrToLower(s);
  if (v.empty() || v == "auto") return std::optional<KvCacheDType>();
  if (v == "f32" || v == "fp32" || v == "float32") return KvCacheDType::kF32;
  if (v == "bf16" || v == "bfloat16") return KvCacheDType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat(
      "kv_cache_dtype must be auto, f32 or bf16, got \"", s, "\""));
}

absl::Status ValidateKvCacheOptions(const KvCacheOptions& o,
                                    size_t bytes_per_token) {
  if (o.block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv block_size must be >= 1, got ", o.block_size));
  }
  if (o.pool_bytes != 0 &&
      o.pool_bytes < bytes_per_token * static_cast<size_t>(o.block_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache pool of ", o.pool_bytes, " bytes holds no block of ",
        o.block_size, " tokens (", bytes_per_token * o.block_size,
        " bytes)"));
  }
  return absl::OkStatus();
}

int KvPoolBlocks(const KvCacheOptions& o, size_t bytes_per_token,
                 int max_context) {
  return o.pool_bytes == 0
             ? PagedKvCache::BlocksForTokens(max_context, o.block_size)
             : PagedKvCache::BlocksForBytes(o.pool_bytes, o.block_size,
                                            bytes_per_token);
}

size_t CpuModelRunner::BytesPerToken(const ModelConfig& c, KvCacheDType t) {
  const size_t element = t == KvCacheDType::kBF16 ? 2 : sizeof(float);
  return 2 * element * static_cast<size_t>(c.num_hidden_layers) *
         c.num_key_value_heads * c.head_dim;
}

WeightDType CpuModelRunner::WeightDTypeFor(const ModelWeights& weights) {
  return weights.checkpoint_dtype == DType::kBF16 ? WeightDType::kBF16
                                                  : WeightDType::kF32;
}

absl::StatusOr<std::unique_ptr<CpuModelRunner>> CpuModelRunner::Create(
    std::shared_ptr<const ModelWeights> weights, const KvCacheOptions& o,
    std::optional<WeightDType> weight_dtype) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CpuModelRunner: weights is null");
  }
  const ModelConfig& c = weights->config;
  const size_t per_token = BytesPerToken(c, o.dtype);
  if (absl::Status s = ValidateKvCacheOptions(o, per_token); !s.ok()) return s;
  const int num_blocks = KvPoolBlocks(o, per_token, c.max_position_embeddings);
  std::unique_ptr<CpuModelRunner> r(new CpuModelRunner(c, o, num_blocks));
  r->weight_dtype_ = weight_dtype.value_or(WeightDTypeFor(*weights));
  r->PackWeights(*weights, nullptr);
  return r;
}

absl::StatusOr<std::unique_ptr<CpuModelRunner>> CpuModelRunner::Create(
    ModelWeights&& weights, const KvCacheOptions& o,
    std::optional<WeightDType> weight_dtype) {
  const ModelConfig& c = weights.config;
  const size_t per_token = BytesPerToken(c, o.dtype);
  if (absl::Status s = ValidateKvCacheOptions(o, per_token); !s.ok()) return s;
  const int num_blocks = KvPoolBlocks(o, per_token, c.max_position_embeddings);
  std::unique_ptr<CpuModelRunner> r(new CpuModelRunner(c, o, num_blocks));
  r->weight_dtype_ = weight_dtype.value_or(WeightDTypeFor(weights));
  r->PackWeights(weights, &weights);
  return r;
}

absl::StatusOr<std::unique_ptr<CpuModelRunner>> CpuModelRunner::Load(
    const std::string& model_dir, const KvCacheOptions& o,
    std::optional<WeightDType> weight_dtype) {
  // Every Linear weight (and the embedding table) is packed straight from
  // the mapped checkpoint, 32 rows at a time: no f32 copy of the model
  // exists at any point, and each tensor's file pages are dropped once it
  // is packed.
  std::vector<PackedLayer> layers;
  PackedMatrix lm_head, embed;
  WeightDType t = WeightDType::kF32;
  auto pack = [&t](const LinearView& v) {
    return PackedMatrix::PackRows(
        [&v](int begin, int end, float* dst) { v.RowsToFloat(begin, end, dst); },
        static_cast<int>(v.rows()), static_cast<int>(v.cols), t);
  };
  LoadWeightsOptions lo;
  lo.on_embeddings = [&](const ModelWeights& partial, const LinearView& e,
                         const LinearView* head) {
    t = weight_dtype.value_or(WeightDTypeFor(partial));
    if (head == nullptr) {  // tied: lm_head's rows are the table
      lm_head = pack(e);
    } else {
      lm_head = pack(*head);
      embed = pack(e);
    }
    return absl::OkStatus();
  };
  lo.on_linear_layer = [&](const ModelWeights& partial, int l,
                           const LayerLinearViews& v) {
    layers.resize(partial.layers.size());
    layers[l] = PackedLayer{pack(v.wqkv), pack(v.wo), pack(v.w_gate_up),
                            pack(v.w_down)};
    return absl::OkStatus();
  };
  absl::StatusOr<ModelWeights> w = LoadModelWeights(model_dir, lo);
  if (!w.ok()) return w.status();
  const ModelConfig& c = w->config;
  const size_t per_token = BytesPerToken(c, o.dtype);
  if (absl::Status s = ValidateKvCacheOptions(o, per_token); !s.ok()) return s;
  const int num_blocks = KvPoolBlocks(o, per_token, c.max_position_embeddings);
  std::unique_ptr<CpuModelRunner> r(new CpuModelRunner(c, o, num_blocks));
  r->weight_dtype_ = t;
  r->packed_ = std::move(layers);
  r->lm_head_ = std::move(lm_head);
  r->embed_ = std::move(embed);
  r->weights_ = std::make_shared<const ModelWeights>(SmallParameters(*w));
  return r;
}

absl::StatusOr<std::unique_ptr<CpuModelRunner>>
CpuModelRunner::CreateForSequences(std::shared_ptr<const ModelWeights> weights,
                                   int sequences, int block_size,
                                   std::optional<WeightDType> weight_dtype,
                                   KvCacheDType kv_dtype) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CpuModelRunner: weights is null");
  }
  KvCacheOptions o;
  o.block_size = block_size;
  o.dtype = kv_dtype;
  o.pool_bytes = BytesPerToken(weights->config, o.dtype) *
                 PagedKvCache::BlocksForTokens(
                     weights->config.max_position_embeddings, block_size) *
                 block_size * std::max(sequences, 1);
  return Create(std::move(weights), o, weight_dtype);
}

CpuModelRunner::CpuModelRunner(const ModelConfig& c, const KvCacheOptions& o,
                               int num_blocks)
    : row_width_(c.num_key_value_heads * c.head_dim),
      rope_(ComputeRopeFrequencies(c)),
      kv_dtype_(o.dtype),
      chunk_major_(o.dtype == KvCacheDType::kF32 &&
                   kernels::UsesChunkMajorKv(c.head_dim, o.block_size)) {
  cache_ = std::make_unique<PagedKvCache>(
      num_blocks, o.block_size, BytesPerToken(c, o.dtype),
      [this](int src, int dst) { return CopyBlock(src, dst); });
  cache_->EnablePrefixCaching(o.prefix_caching);
  const size_t n = static_cast<size_t>(num_blocks) * o.block_size * row_width_;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    // Fresh mappings: pages are committed only when first written.
    HugePageArena& arena = HugePageArena::Default();
    if (kv_dtype_ == KvCacheDType::kBF16) {
      kb_.push_back(arena.AllocateArray<uint16_t>(n));
      vb_.push_back(arena.AllocateArray<uint16_t>(n));
    } else {
      k_.push_back(arena.AllocateArray<float>(n));
      v_.push_back(arena.AllocateArray<float>(n));
    }
  }
}

void CpuModelRunner::KeyRow(int layer, size_t row, float* out) const {
  const size_t at = row * row_width_;
  if (kv_dtype_ == KvCacheDType::kBF16) {
    kernels::Bf16ToFloatRow(kb_[layer].get() + at, row_width_, out);
  } else {
    ReadRow(k_[layer].get(), row, out);
  }
}

void CpuModelRunner::ValueRow(int layer, size_t row, float* out) const {
  const size_t at = row * row_width_;
  if (kv_dtype_ == KvCacheDType::kBF16) {
    kernels::Bf16ToFloatRow(vb_[layer].get() + at, row_width_, out);
  } else {
    ReadRow(v_[layer].get(), row, out);
  }
}

void CpuModelRunner::ReadRow(const float* plane, size_t slot,
                             float* out) const {
  if (!chunk_major_) {
    std::memcpy(out, plane + slot * row_width_, row_width_ * sizeof(float));
    return;
  }
  const int D = weights_->config.head_dim, KV = row_width_ / D;
  const int bs = cache_->block_size();
  for (int g = 0; g < KV; ++g) {
    const float* src =
        plane + kernels::ChunkMajorKvOffset(slot, g, 0, KV, D, bs);
    for (int d = 0; d < D; ++d) out[g * D + d] = src[d * bs];
  }
}

void CpuModelRunner::WriteRow(const float* row, size_t slot,
                              float* plane) const {
  if (!chunk_major_) {
    std::memcpy(plane + slot * row_width_, row, row_width_ * sizeof(float));
    return;
  }
  const int D = weights_->config.head_dim, KV = row_width_ / D;
  const int bs = cache_->block_size();
  for (int g = 0; g < KV; ++g) {
    float* dst = plane + kernels::ChunkMajorKvOffset(slot, g, 0, KV, D, bs);
    for (int d = 0; d < D; ++d) dst[d * bs] = row[g * D + d];
  }
}

void CpuModelRunner::PackWeights(const ModelWeights& w, ModelWeights* owned) {
  const ModelConfig& c = w.config;
  const int hidden = c.hidden_size;
  const WeightDType t = weight_dtype_;
  if (packed_.size() != w.layers.size()) {
    packed_.resize(w.layers.size());
    // Layers pack independently: spread over the engine's threads.
    ThreadPool::Default().ParallelFor(
        static_cast<int>(w.layers.size()), 1, [&](int begin, int end) {
          for (int l = begin; l < end; ++l) {
            packed_[l] = PackLayer(c, w.layers[l], t,
                                   owned ? &owned->layers[l] : nullptr);
          }
        });
  }
  lm_head_ = PackedMatrix::Pack(w.lm_head(), c.vocab_size, hidden, t);
  if (!w.lm_head_weight.empty()) {  // untied: the table of its own
    embed_ = PackedMatrix::Pack(w.embed.data(), c.vocab_size, hidden, t);
  }
  weights_ = std::make_shared<const ModelWeights>(SmallParameters(w));
  if (owned != nullptr) {
    FreeVector(&owned->embed);
    FreeVector(&owned->lm_head_weight);
  }
}

CpuModelRunner::PackedLayer CpuModelRunner::PackLayer(const ModelConfig& c,
                                                      const LayerWeights& w,
                                                      WeightDType t,
                                                      LayerWeights* owned) {
  const int hidden = c.hidden_size, ffn = c.intermediate_size;
  PackedLayer p;
  p.wqkv = PackedMatrix::Pack(w.wqkv.data(), c.qkv_dim(), hidden, t);
  p.wo = PackedMatrix::Pack(w.wo.data(), hidden,
                            c.num_attention_heads * c.head_dim, t);
  p.w_gate_up = PackedMatrix::Pack(w.w_gate_up.data(), 2 * ffn, hidden, t);
  p.w_down = PackedMatrix::Pack(w.w_down.data(), hidden, ffn, t);
  if (owned != nullptr) {
    FreeVector(&owned->wqkv);
    FreeVector(&owned->wo);
    FreeVector(&owned->w_gate_up);
    FreeVector(&owned->w_down);
  }
  return p;
}

void CpuModelRunner::Embed(int id, float* dst) const {
  (embed_.out() > 0 ? embed_ : lm_head_).DequantizeRow(id, dst);
}

size_t CpuModelRunner::weight_bytes() const {
  size_t n = weights_->bytes() + lm_head_.bytes() + embed_.bytes();
  for (const PackedLayer& p : packed_) {
    n += p.wqkv.bytes() + p.wo.bytes() + p.w_gate_up.bytes() +
         p.w_down.bytes();
  }
  return n;
}

absl::Status CpuModelRunner::CopyBlock(int src, int dst) {
  const size_t rows = cache_->block_size();
  const size_t len = rows * row_width_;
  for (size_t l = 0; l < k_.size(); ++l) {
    std::memcpy(&k_[l][dst * len], &k_[l][src * len], len * sizeof(float));
    std::memcpy(&v_[l][dst * len], &v_[l][src * len], len * sizeof(float));
  }
  for (size_t l = 0; l < kb_.size(); ++l) {
    std::memcpy(&kb_[l][dst * len], &kb_[l][src * len],
                len * sizeof(uint16_t));
    std::memcpy(&vb_[l][dst * len], &vb_[l][src * len],
                len * sizeof(uint16_t));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<QueryCapture>> CpuModelRunner::NewQueryCapture(
    int max_rows) {
  if (max_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("query capture: max_rows must be >= 1, got ", max_rows));
  }
  return std::make_unique<CpuQueryCapture>(config(), max_rows);
}

void CpuModelRunner::DenseKv(int layer, const KvSequence& kv, int count,
                             std::vector<float>* k_buf,
                             std::vector<float>* v_buf, const float** k,
                             const float** v) const {
  const int bs = kv.block_size();
  const int nb = PagedKvCache::BlocksForTokens(count, bs);
  const std::vector<int>& table = kv.block_table();
  bool contiguous = true;
  for (int b = 1; b < nb && contiguous; ++b) {
    contiguous = table[b] == table[0] + b;
  }
  const size_t base = static_cast<size_t>(table[0]) * bs * row_width_;
  if (kv_dtype_ == KvCacheDType::kBF16) {
    // The GEMMs take f32: widen, block by block, into the scratch.
    k_buf->resize(static_cast<size_t>(count) * row_width_);
    v_buf->resize(static_cast<size_t>(count) * row_width_);
    for (int b = 0; b < nb; ++b) {
      const size_t rows = std::min(bs, count - b * bs);
      const size_t src = static_cast<size_t>(table[b]) * bs * row_width_;
      const size_t dst = static_cast<size_t>(b) * bs * row_width_;
      kernels::Bf16ToFloatRow(kb_[layer].get() + src, rows * row_width_,
                              k_buf->data() + dst);
      kernels::Bf16ToFloatRow(vb_[layer].get() + src, rows * row_width_,
                              v_buf->data() + dst);
    }
    *k = k_buf->data();
    *v = v_buf->data();
    return;
  }
  if (contiguous && !chunk_major_) {
    *k = k_[layer].get() + base;
    *v = v_[layer].get() + base;
    return;
  }
  k_buf->resize(static_cast<size_t>(count) * row_width_);
  v_buf->resize(static_cast<size_t>(count) * row_width_);
  if (chunk_major_) {  // back to rows (Speculative Prefill's scoring)
    for (int t = 0; t < count; ++t) {
      const size_t slot = static_cast<size_t>(table[t / bs]) * bs + t % bs;
      ReadRow(k_[layer].get(), slot, k_buf->data() + t * row_width_);
      ReadRow(v_[layer].get(), slot, v_buf->data() + t * row_width_);
    }
    *k = k_buf->data();
    *v = v_buf->data();
    return;
  }
  for (int b = 0; b < nb; ++b) {
    const int rows = std::min(bs, count - b * bs);
    const size_t src = static_cast<size_t>(table[b]) * bs * row_width_;
    const size_t dst = static_cast<size_t>(b) * bs * row_width_;
    std::memcpy(k_buf->data() + dst, k_[layer].get() + src,
                rows * row_width_ * sizeof(float));
    std::memcpy(v_buf->data() + dst, v_[layer].get() + src,
                rows * row_width_ * sizeof(float));
  }
  *k = k_buf->data();
  *v = v_buf->data();
}

void CpuModelRunner::Attention(int n, int first, const float* q,
                               size_t q_stride, const float* K, const float* V,
                               const TreeMask& mask, float* attn_out,
                               Scratch* scratch) const {
  const ModelConfig& c = weights_->config;
  const int H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int D = c.head_dim, group = c.gqa_group();
  const int rw = row_width_;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int total = first + n;

  int block = std::max(1, kTargetGemmRows / group);
  block = std::min(block, n);
  while (block > 1 &&
         static_cast<size_t>(block) * group * total > kMaxScoreFloats) {
    block /= 2;
  }
  // resize() keeps the capacity, so only the first call allocates.
  std::vector<float>& qg = scratch->qg;
  std::vector<float>& og = scratch->og;
  std::vector<float>& s = scratch->scores;
  qg.resize(static_cast<size_t>(block) * group * D);
  og.resize(static_cast<size_t>(block) * group * D);
  s.resize(static_cast<size_t>(block) * group * total);

  for (int g = 0; g < KV; ++g) {
    for (int i0 = 0; i0 < n; i0 += block) {
      const int i1 = std::min(n, i0 + block);
      const int m = (i1 - i0) * group;
      const int nk = first + i1;  // keys visible to the block's last row
      // Gather the group's query heads: row (i - i0) * group + hh.
      for (int i = i0; i < i1; ++i) {
        for (int hh = 0; hh < group; ++hh) {
          std::memcpy(&qg[(static_cast<size_t>(i - i0) * group + hh) * D],
                      q + static_cast<size_t>(i) * q_stride +
                          (g * group + hh) * D,
                      D * sizeof(float));
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nk, D, scale,
                  qg.data(), D, K + g * D, rw, 0.f, s.data(), nk);
      for (int i = i0; i < i1; ++i) {
        const int allowed = first + i + 1;  // causal over cache order
        for (int hh = 0; hh < group; ++hh) {
          float* row = &s[(static_cast<size_t>(i - i0) * group + hh) * nk];
          if (!mask.empty() && mask.offsets[i + 1] > mask.offsets[i]) {
            kernels::MaskScores(row, &mask.masked_keys[mask.offsets[i]],
                                mask.offsets[i + 1] - mask.offsets[i]);
          }
          kernels::SoftmaxPrefix(row, allowed, nk);
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, D, nk, 1.f,
                  s.data(), nk, V + g * D, rw, 0.f, og.data(), D);
      for (int i = i0; i < i1; ++i) {
        for (int hh = 0; hh < group; ++hh) {
          std::memcpy(attn_out + static_cast<size_t>(i) * H * D +
                          (g * group + hh) * D,
                      &og[(static_cast<size_t>(i - i0) * group + hh) * D],
                      D * sizeof(float));
        }
      }
    }
  }
}

namespace {

// One task of the direct attention: rows [row_begin, row_end) of
// sequence `sequence` (a batch index).
struct AttentionItem {
  int sequence;
  int row_begin;
  int row_end;
};

// The direct-attention tasks of a forward for `threads` threads: one per
// sequence, except that a sequence holding more than a thread's share of
// the multiply-adds is cut into row ranges of about that share, so that a
// verify round or a prefill chunk at batch 1 uses every core. Row t of a
// sequence whose rows start at cache index f costs (f + t + 1) key visits
// (causal), which the cuts follow.
std::vector<AttentionItem> SplitAttentionWork(const std::vector<int>& direct,
                                              const std::vector<int>& row0,
                                              const std::vector<int>& first,
                                              int threads) {
  std::vector<AttentionItem> items;
  int64_t total = 0;
  auto work = [&](int i) {
    const int64_t n = row0[i + 1] - row0[i];
    return n * first[i] + n * (n + 1) / 2;
  };
  for (int i : direct) total += work(i);
  const int64_t share = std::max<int64_t>(1, total / std::max(1, threads));
  for (int i : direct) {
    const int n = row0[i + 1] - row0[i];
    const int64_t w = work(i);
    const int parts =
        static_cast<int>(std::min<int64_t>(n, (w + share - 1) / share));
    if (parts <= 1) {
      items.push_back({i, 0, n});
      continue;
    }
    int begin = 0, part = 1;
    int64_t done = 0;
    for (int t = 0; t < n; ++t) {
      done += first[i] + t + 1;
      // A range closes once the rows so far hold part / parts of the work.
      if (done * parts >= w * part || t + 1 == n) {
        items.push_back({i, begin, t + 1});
        begin = t + 1;
        ++part;
      }
    }
  }
  return items;
}

}  // namespace

absl::Status CpuModelRunner::Forward(absl::Span<const SequenceForward> batch,
                                     std::vector<ForwardOutput>* out) {
  const ModelConfig& c = weights_->config;
  absl::StatusOr<std::vector<std::vector<int>>> rows_or =
      ValidateBatch(c, *cache_, batch);
  if (!rows_or.ok()) return rows_or.status();
  std::vector<std::vector<int>> logit_rows = *std::move(rows_or);
  const int S = static_cast<int>(batch.size());
  for (int i = 0; i < S; ++i) {
    QueryCapture* cap = batch[i].capture;
    if (cap == nullptr) continue;
    if (dynamic_cast<CpuQueryCapture*>(cap) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch[", i, "]: the query capture belongs to another backend"));
    }
    const int nq = static_cast<int>(batch[i].input.capture_query_rows.size());
    if (cap->rows() + nq > cap->max_rows()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "query capture full: ", cap->rows(), " rows + ", nq,
          " new exceed max_rows ", cap->max_rows()));
    }
  }
  std::vector<int> first;
  if (absl::Status s = ReserveBatch(batch, &first); !s.ok()) return s;

  // Rows of all sequences, concatenated: sequence i owns [row0[i],
  // row0[i + 1]).
  std::vector<int> row0(S + 1, 0);
  for (int i = 0; i < S; ++i) {
    row0[i + 1] = row0[i] + static_cast<int>(batch[i].input.token_ids.size());
  }
  const int N = row0[S];
  std::vector<int> positions(N);
  for (int i = 0; i < S; ++i) {
    std::copy(batch[i].input.position_ids.begin(),
              batch[i].input.position_ids.end(), positions.begin() + row0[i]);
  }

  // Tree attention masks (empty for causal entries), the same every layer.
  std::vector<TreeMask> masks(S);
  for (int i = 0; i < S; ++i) {
    masks[i] = TreeAttentionMask(batch[i].input.tree_parents, first[i],
                                 row0[i + 1] - row0[i]);
  }

  const int hidden = c.hidden_size, H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim;
  const int ffn = c.intermediate_size, qkv_dim = c.qkv_dim();
  const int rw = row_width_;
  const size_t NN = N;

  // Sequences whose few new rows attend without GEMMs, and their work
  // (multiply-adds) to decide whether to wake the pool.
  std::vector<int> direct;
  int64_t direct_work = 0;
  // The small-head kernel addresses the planes with 32-bit offsets.
  // (The chunk-major kernel uses 64-bit offsets.)
  const bool small_head =
      chunk_major_ ||
      (kv_dtype_ == KvCacheDType::kF32 && kernels::HasSmallHeadAttention(D) &&
       static_cast<int64_t>(cache_->num_blocks()) * cache_->block_size() *
               rw <
           (int64_t{1} << 31));
  const int max_direct = small_head          ? std::numeric_limits<int>::max()
                         : D < kSmallHeadDim ? kMaxDirectAttentionRowsSmallHead
                                             : kMaxDirectAttentionRows;
  for (int i = 0; i < S; ++i) {
    const int n = row0[i + 1] - row0[i];
    if (n <= max_direct) {
      direct.push_back(i);
      direct_work += int64_t{2} * n * (first[i] + n) * H * D;
    }
  }
  // Little attention work runs on the calling thread, in one task per
  // sequence.
  const int attention_threads = direct_work < kMinParallelMacs
                                    ? 1
                                    : ThreadPool::Default().num_threads();
  const std::vector<AttentionItem> items =
      SplitAttentionWork(direct, row0, first, attention_threads);
  const bool parallel_attention = attention_threads > 1 && items.size() > 1;
  // The first layer's attention is a few microseconds of GEMMs away: start
  // the sleeping workers now.
  if (parallel_attention) ThreadPool::Default().Wake();

  // Activations live in per-thread buffers that keep their capacity:
  // fresh multi-megabyte vectors per forward cost page faults and memsets
  // comparable to a decode step's arithmetic. Every element read below is
  // written first in the same forward.
  thread_local ActivationBuffers buffers;
  std::vector<float>& x = buffers.Get(0, NN * hidden);
  std::vector<float>& h = buffers.Get(1, NN * hidden);
  std::vector<float>& qkv = buffers.Get(2, NN * qkv_dim);
  std::vector<float>& attn = buffers.Get(3, NN * H * D);
  std::vector<float>& gu = buffers.Get(4, NN * 2 * ffn);
  std::vector<float>& act = buffers.Get(5, NN * ffn);
  Scratch& scratch = buffers.scratch;
  PackedMatrix::Input& input = buffers.input;
  for (int i = 0; i < S; ++i) {
    const ForwardInput& in = batch[i].input;
    for (size_t t = 0; t < in.token_ids.size(); ++t) {
      Embed(in.token_ids[t], &x[(row0[i] + t) * static_cast<size_t>(hidden)]);
    }
  }
  out->assign(S, ForwardOutput());
  const size_t qrow = static_cast<size_t>(H) * D;
  for (int i = 0; i < S; ++i) {
    const int nq = static_cast<int>(batch[i].input.capture_query_rows.size());
    if (batch[i].capture == nullptr) {
      (*out)[i].queries.assign(c.num_hidden_layers * nq * qrow, 0.f);
    }
  }

  // The last layer computes only the rows whose output is read: from each
  // sequence's first logit row on (a prefill chunk: its last row). Every
  // row's K / V is stored and every capture row taken before attention, so
  // the cache and the captures do not change. A tree sequence on the GEMM
  // path keeps all its rows (its mask is indexed from its first row).
  const int L = c.num_hidden_layers;
  std::vector<int> live_from(S, 0), live0(S + 1, 0);
  for (int i = 0; i < S; ++i) {
    const int n = row0[i + 1] - row0[i];
    if (logit_rows[i].empty()) {
      live_from[i] = n;
    } else if (masks[i].empty() || n <= max_direct) {
      live_from[i] =
          *std::min_element(logit_rows[i].begin(), logit_rows[i].end());
    }
    live0[i + 1] = live0[i] + n - live_from[i];
  }
  const int NL = live0[S];
  const bool prune = NL < N;

  for (int l = 0; l < L; ++l) {
    // The last layer, when it prunes: sequence i computes its rows
    // [live_from[i], n) from attention on.
    const bool last_pruned = prune && l == L - 1;
    const LayerWeights& w = weights_->layers[l];
    kernels::RmsNorm(x.data(), hidden, w.attn_norm.data(), c.rms_norm_eps, N,
                     hidden, h.data(), hidden);
    const PackedLayer& pw = packed_[l];
    PackedLinear(pw.wqkv, h.data(), N, qkv.data(), 0.f, kMaxGemvRows, &input);
    if (!w.bqkv.empty()) {  // Qwen2
      kernels::AddBias(qkv.data(), qkv_dim, N, qkv_dim, w.bqkv.data());
    }
    if (!w.q_norm.empty()) {
      // Qwen3: RMSNorm of every q and k head over head_dim, before RoPE.
      for (int t = 0; t < N; ++t) {
        float* row = &qkv[t * static_cast<size_t>(qkv_dim)];
        kernels::RmsNorm(row, D, w.q_norm.data(), c.rms_norm_eps, H, D, row,
                         D);
        kernels::RmsNorm(row + H * D, D, w.k_norm.data(), c.rms_norm_eps, KV,
                         D, row + H * D, D);
      }
    }
    // RoPE on q heads and k heads (contiguous: q then k in each row).
    kernels::ApplyRope(qkv.data(), qkv_dim, N, H + KV, D, positions.data(),
                       rope_.inv_freq.data(), rope_.attention_factor);
    const bool bf16 = kv_dtype_ == KvCacheDType::kBF16;
    float* kc = bf16 ? nullptr : k_[l].get();
    float* vc = bf16 ? nullptr : v_[l].get();
    uint16_t* kh = bf16 ? kb_[l].get() : nullptr;
    uint16_t* vh = bf16 ? vb_[l].get() : nullptr;
    for (int i = 0; i < S; ++i) {
      const SequenceForward& e = batch[i];
      const std::vector<int>& cap_rows = e.input.capture_query_rows;
      const int nq = static_cast<int>(cap_rows.size());
      for (int j = 0; j < nq; ++j) {
        const float* src = &qkv[(row0[i] + cap_rows[j]) * static_cast<size_t>(qkv_dim)];
        float* dst =
            e.capture != nullptr
                ? static_cast<CpuQueryCapture*>(e.capture)->row(
                      l, e.capture->rows() + j)
                : &(*out)[i].queries[((static_cast<size_t>(l) * nq) + j) *
                                     qrow];
        std::memcpy(dst, src, qrow * sizeof(float));
      }
      const int n = row0[i + 1] - row0[i];
      for (int t = 0; t < n; ++t) {
        const float* row = &qkv[(row0[i] + t) * static_cast<size_t>(qkv_dim)];
        const size_t slot = e.kv->PhysicalSlot(first[i] + t);
        if (bf16) {
          kernels::FloatToBf16Row(row + H * D, rw, kh + slot * rw);
          kernels::FloatToBf16Row(row + (H + KV) * D, rw, vh + slot * rw);
        } else {
          WriteRow(row + H * D, slot, kc);
          WriteRow(row + (H + KV) * D, slot, vc);
        }
      }
      const int skip = last_pruned ? live_from[i] : 0;
      if (n > max_direct && skip < n) {
        // Prefill chunks: GEMMs (OpenBLAS's threads) over dense K/V.
        const float *K, *V;
        DenseKv(l, *e.kv, first[i] + n, &scratch.k_dense, &scratch.v_dense,
                &K, &V);
        Attention(n - skip, first[i] + skip,
                  &qkv[(row0[i] + skip) * static_cast<size_t>(qkv_dim)],
                  qkv_dim, K, V, masks[i], &attn[(row0[i] + skip) * qrow],
                  &scratch);
      }
    }
    // Decode and verify rows: straight from the blocks, the work items
    // (row ranges of sequences) spread over the engine's threads.
    if (!direct.empty()) {
      const float scale = 1.f / std::sqrt(static_cast<float>(D));
      auto attend = [&](int b, int e) {
        // Per thread, kept across layers and steps: num_heads * context
        // floats (256 KB at 32 heads x 2K tokens) would otherwise be a heap
        // allocation, at that size an mmap, per layer. The small-head
        // kernels size it themselves.
        thread_local std::vector<float> scores;
        for (int d = b; d < e; ++d) {
          const AttentionItem& item = items[d];
          const int i = item.sequence;
          const int r = last_pruned ? std::max(item.row_begin, live_from[i])
                                    : item.row_begin;
          const int n = item.row_end - r;
          if (n <= 0) continue;
          const int f = first[i] + r;
          const float* qi =
              &qkv[(row0[i] + r) * static_cast<size_t>(qkv_dim)];
          const int* table = batch[i].kv->block_table().data();
          const int bs = batch[i].kv->block_size();
          const int* mo =
              masks[i].empty() ? nullptr : masks[i].offsets.data() + r;
          const int* mk =
              masks[i].empty() ? nullptr : masks[i].masked_keys.data();
          float* o = &attn[(row0[i] + r) * qrow];
          if (chunk_major_) {
            kernels::AttentionRowsSmallHeadChunkMajor(
                qi, qkv_dim, n, f, H, KV, D, kc, vc, table, bs, scale,
                &scores, o, qrow, mo, mk);
          } else if (small_head) {
            kernels::AttentionRowsSmallHead(qi, qkv_dim, n, f, H, KV, D, kc,
                                            vc, rw, table, bs, scale, &scores,
                                            o, qrow, mo, mk);
          } else {
            scores.resize(static_cast<size_t>(H) * (f + n));
            if (bf16) {
              kernels::AttentionRows(qi, qkv_dim, n, f, H, KV, D, kh, vh, rw,
                                     table, bs, scale, scores.data(), o, qrow,
                                     mo, mk);
            } else {
              kernels::AttentionRows(qi, qkv_dim, n, f, H, KV, D, kc, vc, rw,
                                     table, bs, scale, scores.data(), o, qrow,
                                     mo, mk);
            }
          }
        }
      };
      if (!parallel_attention) {
        attend(0, static_cast<int>(items.size()));
      } else {
        ThreadPool::Default().ParallelFor(static_cast<int>(items.size()), 1,
                                          attend);
      }
    }
    // o_proj and the MLP over the rows this layer computes: all of them,
    // or the last layer's live rows moved to the front of x and attn (a
    // row only moves down, so in place).
    int rows = N;
    if (last_pruned) {
      for (int i = 0; i < S; ++i) {
        const int n = row0[i + 1] - row0[i];
        for (int t = live_from[i]; t < n; ++t) {
          const size_t from = row0[i] + t;
          const size_t to = live0[i] + t - live_from[i];
          if (from == to) continue;
          std::memmove(&x[to * hidden], &x[from * hidden],
                       hidden * sizeof(float));
          std::memmove(&attn[to * qrow], &attn[from * qrow],
                       qrow * sizeof(float));
        }
      }
      rows = NL;
    }
    PackedLinear(pw.wo, attn.data(), rows, x.data(), 1.f, kMaxGemvRows,
                 &input);
    if (!w.bo.empty()) {
      kernels::AddBias(x.data(), hidden, rows, hidden, w.bo.data());
    }
    kernels::RmsNorm(x.data(), hidden, w.mlp_norm.data(), c.rms_norm_eps,
                     rows, hidden, h.data(), hidden);
    PackedLinear(pw.w_gate_up, h.data(), rows, gu.data(), 0.f, kMaxGemvRows,
                 &input);
    kernels::SiluMul(gu.data(), rows, ffn, act.data());
    PackedLinear(pw.w_down, act.data(), rows, x.data(), 1.f, kMaxGemvRows,
                 &input);
  }
  for (int i = 0; i < S; ++i) {
    if (batch[i].capture != nullptr) {
      static_cast<CpuQueryCapture*>(batch[i].capture)->rows_ +=
          static_cast<int>(batch[i].input.capture_query_rows.size());
    }
  }

  // Final norm and vocabulary projection for the requested rows of every
  // sequence, in one GEMM.
  int R = 0;
  for (const auto& r : logit_rows) R += static_cast<int>(r.size());
  std::vector<float>& hr = buffers.Get(6, static_cast<size_t>(R) * hidden);
  int j = 0;
  for (int i = 0; i < S; ++i) {
    for (int r : logit_rows[i]) {
      // x holds the last layer's rows: the live ones, compacted, if pruned.
      const size_t row = prune ? live0[i] + r - live_from[i] : row0[i] + r;
      kernels::RmsNorm(&x[row * static_cast<size_t>(hidden)], hidden,
                       weights_->final_norm.data(), c.rms_norm_eps, 1, hidden,
                       &hr[j++ * static_cast<size_t>(hidden)], hidden);
    }
  }
  std::vector<float>& logits =
      buffers.Get(7, static_cast<size_t>(R) * c.vocab_size);
  PackedLinear(lm_head_, hr.data(), R, logits.data(), 0.f, kMaxGemvRows,
               &input);
  size_t off = 0;
  for (int i = 0; i < S; ++i) {
    const size_t len = logit_rows[i].size() * static_cast<size_t>(c.vocab_size);
    (*out)[i].logits.assign(logits.begin() + off, logits.begin() + off + len);
    (*out)[i].logit_rows = std::move(logit_rows[i]);
    off += len;
  }
  ReduceToArgmax(batch, c.vocab_size, out);
  SampleOnHost(batch, c.vocab_size, out);
  return absl::OkStatus();
}

absl::StatusOr<ImportanceResult> CpuModelRunner::ScoreImportance(
    const KvSequence& kv, int prompt_len, const QueryCapture& capture,
    const ScoringOptions& options, int num_threads) {
  const ModelConfig& c = config();
  const auto* cap = dynamic_cast<const CpuQueryCapture*>(&capture);
  if (absl::Status s = ValidateScoringInput(cap, kv, prompt_len); !s.ok()) {
    return s;
  }
  const int rows = cap->rows();
  const int H = c.num_attention_heads, D = c.head_dim;
  absl::StatusOr<ImportanceAccumulator> acc = ImportanceAccumulator::Create(
      prompt_len, rows, H, c.num_key_value_heads, D, c.num_hidden_layers,
      options);
  if (!acc.ok()) return acc.status();
  // Spawning workers costs tens of microseconds per layer: small prompts
  // (tiny models, short inputs) score on the calling thread.
  const int64_t work = int64_t{prompt_len} * rows * H * D;
  acc->set_num_threads(work < (int64_t{1} << 20) ? 1 : num_threads);
  std::vector<float> k_buf, v_buf;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!acc->UsesLayer(l)) continue;
    const float *K, *V;
    DenseKv(l, kv, prompt_len, &k_buf, &v_buf, &K, &V);
    if (absl::Status s = acc->AddLayer(l, cap->layer(l), K, row_width_);
        !s.ok()) {
      return s;
    }
  }
  ImportanceResult result;
  result.importance = acc->Importance();
  result.per_row_importance = acc->PerRowImportance();
  return result;
}

void SetEngineThreads(int n) {
  if (n > 0) {
    openblas_set_num_threads(n);
    ThreadPool::SetDefaultThreads(n);
  }
}

std::string OpenBlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

void MaybeReexecForAvx512(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return;
  // Newer OpenBLAS builds detect AVX-512 cores themselves (e.g. Cooperlake,
  // SkylakeX); only AVX2 fallbacks (Haswell, Zen) need the override.
  const std::string core = openblas_get_corename();
  if (core.find("lake") != std::string::npos ||
      core.find("Sapphire") != std::string::npos) {
    return;
  }
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  execv("/proc/self/exe", argv);
  // execv failed: carry on with the default kernels.
}

}  // namespace specserve
