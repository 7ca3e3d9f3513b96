#ifndef SPECSERVE_COMMON_ENGINE_CPU_MODEL_RUNNER_H_
#define SPECSERVE_COMMON_ENGINE_CPU_MODEL_RUNNER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/engine/model_runner.h"
#include "common/engine/packed_matrix.h"
#include "common/engine/paged_kv_cache.h"
#include "common/model/rope.h"
#include "common/model/weights.h"

namespace specserve {

/// Element type of the CPU engine's KV cache (`--kv_cache_dtype`). The
/// model computes in f32 either way; bf16 rounds each K / V element to
/// nearest even when its row is stored and halves the bytes per token.
enum class KvCacheDType {
  kF32,   ///< 4 bytes per element; exact.
  kBF16,  ///< 2 bytes per element (the top half of the f32).
};

/// "f32" or "bf16".
std::string KvCacheDTypeName(KvCacheDType t);

/// Parses `--kv_cache_dtype`: "f32" (alias "fp32", "float32"), "bf16"
/// (alias "bfloat16"), or "auto" / "" (nullopt: the backend's default, f32
/// on CPU). Case-insensitive. INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<std::optional<KvCacheDType>> ParseKvCacheDType(
    const std::string& s);

/// Options of a model runner's paged KV cache.
struct KvCacheOptions {
  /// Bytes of K + V the pool holds (the pool gets floor(bytes /
  /// bytes_per_block) blocks). 0 = room for one sequence at the model's max
  /// context.
  size_t pool_bytes = 0;
  int block_size = 16;  ///< tokens per block, >= 1.
  /// Automatic prefix caching (PrefixCache): sequences whose prompts start
  /// with blocks computed before attach them instead of recomputing.
  bool prefix_caching = false;
  /// Element type of K and V on the CPU backend (BytesPerToken follows
  /// it). The CUDA backend stores its cache in its compute dtype and
  /// ignores this field (the factory refuses a mismatch).
  KvCacheDType dtype = KvCacheDType::kF32;
};

/// INVALID_ARGUMENT naming the field for block_size < 1, or a pool smaller
/// than one block.
absl::Status ValidateKvCacheOptions(const KvCacheOptions& options,
                                    size_t bytes_per_token);

/// Blocks of the pool `options` asks for: floor(pool_bytes / bytes per
/// block), or one sequence at `max_context` tokens when pool_bytes is 0.
int KvPoolBlocks(const KvCacheOptions& options, size_t bytes_per_token,
                 int max_context);

/// CPU backend of ModelRunner (HF LlamaForCausalLM semantics, f32
/// activations): embedding, RMSNorm, rotate_half RoPE at explicit position
/// ids, grouped-query causal attention over each sequence's cached + new
/// tokens, SiLU-gated MLP, final norm, tied or separate lm_head.
///
/// Weights: every Linear weight (and the embedding table, which a tied
/// lm_head shares) is held once, as a PackedMatrix in the weight dtype
/// (f32, bf16 or int8 blocks) and 32-column panels; the f32 ModelWeights'
/// copies are released (norms and biases stay f32). The projections and
/// the MLP run over the rows of ALL sequences at once: up to 64 rows
/// (decode and verify rows of many sequences) with the dtype's
/// weight-streaming kernels (read once per batch; AVX-512 / AVX512_BF16 /
/// AVX512-VNNI where available, AVX2 else), beyond that OpenBLAS sgemm
/// over f32 tiles unpacked from the same panels.
/// Attention runs per sequence over its own blocks: sequences with up to
/// 16 new rows straight from the blocks (kernels::AttentionRows, spread
/// over the engine's threads), longer prefill chunks with sgemm over dense
/// K/V (in place when the blocks are physically contiguous, else gathered).
///
/// The KV pool is host memory in KvCacheOptions::dtype (f32, or bf16
/// rounded to nearest even as rows are stored and widened to f32 as they
/// are read), [num_blocks * block_size, kv_heads, head_dim] per layer for
/// K and for V, committed page by page as blocks are first written. Forward calls on distinct sequences may run
/// concurrently.
class CpuModelRunner : public ModelRunner {
 public:
  /// Packs `weights` into `weight_dtype` (nullopt: the checkpoint's dtype,
  /// WeightDTypeFor). The runner drops its reference to `weights` once
  /// packed, so the f32 copy is freed when the caller holds no other.
  /// INVALID_ARGUMENT for null weights or bad cache options.
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> Create(
      std::shared_ptr<const ModelWeights> weights,
      const KvCacheOptions& cache_options = {},
      std::optional<WeightDType> weight_dtype = std::nullopt);

  /// As above, consuming `weights`: each f32 Linear weight is freed as soon
  /// as it is packed, so loading peaks near the f32 weights' size instead
  /// of f32 + packed.
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> Create(
      ModelWeights&& weights, const KvCacheOptions& cache_options = {},
      std::optional<WeightDType> weight_dtype = std::nullopt);

  /// Loads `model_dir` (LoadModelWeights with LinearViews) and packs every
  /// Linear weight and the embedding table into `weight_dtype` (nullopt:
  /// the checkpoint's) straight from the mapped file, 32 rows at a time,
  /// panels spread over the engine's threads: no f32 copy of the model
  /// exists, so loading peaks near the packed weights (1.05x for a BF16
  /// llama-3.2-1b in bf16). The result equals Create on the f32 weights bit
  /// for bit. Errors: LoadModelWeights' and Create's.
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> Load(
      const std::string& model_dir, const KvCacheOptions& cache_options = {},
      std::optional<WeightDType> weight_dtype = std::nullopt);

  /// A runner whose pool holds `sequences` sequences at the model's max
  /// context, K and V in `kv_dtype` (tools, benchmarks, tests).
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> CreateForSequences(
      std::shared_ptr<const ModelWeights> weights, int sequences,
      int block_size = 16,
      std::optional<WeightDType> weight_dtype = std::nullopt,
      KvCacheDType kv_dtype = KvCacheDType::kF32);

  /// `--weight_dtype auto`: bf16 for a BF16 checkpoint, f32 otherwise (F16
  /// widens to f32 exactly; ask for bf16 or int8 to halve or quarter it).
  static WeightDType WeightDTypeFor(const ModelWeights& weights);

  const ModelConfig& config() const override { return weights_->config; }
  std::string backend() const override { return "cpu"; }
  PagedKvCache& kv_cache() override { return *cache_; }
  /// The f32 parameters the runner keeps: config, norms and biases; the
  /// Linear weights and the embedding table are empty (see packed data).
  const ModelWeights& weights() const { return *weights_; }
  /// Element type of the packed Linear weights.
  WeightDType weight_dtype() const { return weight_dtype_; }
  /// Bytes of every packed matrix (the embedding table and the lm_head
  /// once each, once in all when tied) plus the f32 norms and biases.
  size_t weight_bytes() const;

  /// Bytes one token costs across all layers: K and V of every layer in
  /// `dtype` (4 bytes per element for f32, 2 for bf16).
  static size_t BytesPerToken(const ModelConfig& config,
                              KvCacheDType dtype = KvCacheDType::kF32);
  /// Element type of the KV cache.
  KvCacheDType kv_cache_dtype() const { return kv_dtype_; }

  absl::StatusOr<std::unique_ptr<QueryCapture>> NewQueryCapture(
      int max_rows) override;
  using ModelRunner::Forward;
  absl::Status Forward(absl::Span<const SequenceForward> batch,
                       std::vector<ForwardOutput>* out) override;
  absl::StatusOr<ImportanceResult> ScoreImportance(
      const KvSequence& kv, int prompt_len, const QueryCapture& capture,
      const ScoringOptions& options, int num_threads) override;

  /// Layer `layer`'s key (or value) plane of an f32 cache: [num_blocks *
  /// block_size, kv_heads * head_dim]; physical row r at + r *
  /// row_width(), or chunk-major when kv_chunk_major() (small heads, see
  /// kernels::ChunkMajorKvOffset). nullptr when the cache is bf16 (see
  /// keys_bf16()). KeyRow / ValueRow read a row in either layout.
  const float* keys(int layer) const {
    return k_.empty() ? nullptr : k_[layer].get();
  }
  const float* values(int layer) const {
    return v_.empty() ? nullptr : v_[layer].get();
  }
  /// The same planes of a bf16 cache (bfloat16 bits); nullptr when f32.
  const uint16_t* keys_bf16(int layer) const {
    return kb_.empty() ? nullptr : kb_[layer].get();
  }
  const uint16_t* values_bf16(int layer) const {
    return vb_.empty() ? nullptr : vb_[layer].get();
  }
  /// Physical row `row` of layer `layer`'s keys (or values) as f32, either
  /// dtype (bf16 widened exactly); out: [row_width()].
  void KeyRow(int layer, size_t row, float* out) const;
  void ValueRow(int layer, size_t row, float* out) const;
  int row_width() const { return row_width_; }
  /// Whether the f32 planes are chunk-major (kernels::UsesChunkMajorKv:
  /// 8/16-dim heads on AVX-512, block_size a multiple of 16), so
  /// attention reads 16 keys of a dimension as one vector.
  bool kv_chunk_major() const { return chunk_major_; }

 private:
  struct Scratch;
  struct ActivationBuffers;
  CpuModelRunner(const ModelConfig& config, const KvCacheOptions& options,
                 int num_blocks);
  // Row `slot` of an f32 plane (either layout) to / from [row_width] floats.
  void ReadRow(const float* plane, size_t slot, float* out) const;
  void WriteRow(const float* row, size_t slot, float* plane) const;
  // Copy-on-write of one block, every layer.
  absl::Status CopyBlock(int src, int dst);
  // Pointers to `kv`'s first `count` keys and values of `layer` as dense
  // f32 [count, row_width] rows: the pool itself when it is f32 row-major
  // and the blocks are physically contiguous, else gathered (and, for bf16,
  // widened) into the scratch.
  void DenseKv(int layer, const KvSequence& kv, int count,
               std::vector<float>* k_buf, std::vector<float>* v_buf,
               const float** k, const float** v) const;
  // Causal GQA attention of one sequence's n new rows (cache slots
  // [first, first + n)) over K/V rows [0, first + n), less the keys
  // `mask` hides (tree attention; empty = causal).
  void Attention(int n, int first, const float* q, size_t q_stride,
                 const float* K, const float* V, const TreeMask& mask,
                 float* attn_out, Scratch* scratch) const;

  // Packs the Linear weights of `w` (the layers only if packed_ does not
  // hold them yet) and keeps its small parameters; when `owned` (== &w) is
  // given, frees each f32 weight once packed.
  void PackWeights(const ModelWeights& w, ModelWeights* owned);
  // Writes token `id`'s embedding row (f32) to dst [hidden].
  void Embed(int id, float* dst) const;

  struct PackedLayer {
    PackedMatrix wqkv, wo, w_gate_up, w_down;
  };
  // Packs one layer's projections; with `owned`, frees its f32 copies.
  static PackedLayer PackLayer(const ModelConfig& c, const LayerWeights& w,
                               WeightDType t, LayerWeights* owned);

  std::shared_ptr<const ModelWeights> weights_;  // without Linear weights
  WeightDType weight_dtype_ = WeightDType::kF32;
  std::vector<PackedLayer> packed_;
  PackedMatrix lm_head_;
  PackedMatrix embed_;  // empty (out() == 0) when tied: rows of lm_head_
  int row_width_;
  RopeFrequencies rope_;  // from the config's rope_theta / rope_scaling
  std::unique_ptr<PagedKvCache> cache_;
  KvCacheDType kv_dtype_ = KvCacheDType::kF32;
  bool chunk_major_ = false;  // f32 planes in ChunkMajorKvOffset's layout
  // Per layer K and V planes: k_ / v_ for an f32 cache, kb_ / vb_ (bf16
  // bits) for a bf16 one; the other pair is empty. HugePageArena memory:
  // untouched pages cost nothing, and attention streams them.
  std::vector<std::shared_ptr<float[]>> k_;
  std::vector<std::shared_ptr<float[]>> v_;
  std::vector<std::shared_ptr<uint16_t[]>> kb_;
  std::vector<std::shared_ptr<uint16_t[]>> vb_;
};

/// Sets the number of threads OpenBLAS and the engine's pool use
/// (process-wide). n <= 0 keeps the library's default.
void SetEngineThreads(int n);

/// If the CPU has AVX-512 and OPENBLAS_CORETYPE is unset, re-executes the
/// current program with OPENBLAS_CORETYPE=SkylakeX so Debian's OpenBLAS picks
/// its AVX-512 kernels (it reads the variable only when the library loads).
/// Call first thing in main(); returns only when no re-exec happened.
void MaybeReexecForAvx512(char** argv);

/// The OpenBLAS core in use ("Haswell", "SkylakeX", "Cooperlake", ...).
std::string OpenBlasCoreName();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_CPU_MODEL_RUNNER_H_
