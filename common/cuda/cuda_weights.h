#ifndef SPECSERVE_COMMON_CUDA_CUDA_WEIGHTS_H_
#define SPECSERVE_COMMON_CUDA_CUDA_WEIGHTS_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/model/config.h"
#include "common/model/weights.h"

namespace specserve {

/// Device pointers of one decoder layer. Projections are `dtype()` in the
/// fused layouts of LayerWeights ([out, in] row-major); RMSNorm weights stay
/// fp32 (tiny, and the norm is computed in fp32).
struct CudaLayerWeights {
  const float* attn_norm = nullptr;  ///< fp32 [hidden]
  const void* wqkv = nullptr;        ///< T [(H + 2*KV) * head_dim, hidden]
  const void* wo = nullptr;          ///< T [hidden, H * head_dim]
  const float* mlp_norm = nullptr;   ///< fp32 [hidden]
  const void* w_gate_up = nullptr;   ///< T [2 * ffn, hidden]
  const void* w_down = nullptr;      ///< T [hidden, ffn]
  /// fp32 [(H + 2*KV) * head_dim] q/k/v biases, or null (no biases).
  const float* bqkv = nullptr;
  const float* bo = nullptr;      ///< fp32 [hidden] o_proj bias, or null.
  const float* q_norm = nullptr;  ///< fp32 [head_dim] (Qwen3), or null.
  const float* k_norm = nullptr;  ///< fp32 [head_dim] (Qwen3), or null.
};

/// A Llama model's parameters on the device (FasterTransformer's weight
/// struct, apart from the CudaModelRunner that runs them): converted from the
/// host ModelWeights (fp32) to bf16 (default) or fp16 with round-to-nearest-
/// even on the device. Immutable after Upload; shared by any number of
/// CudaModelRunners. Frees its device memory on destruction.
class CudaWeights {
 public:
  /// Uploads `weights` to the current CUDA device as `dtype` (kBF16 or
  /// kFP16), staging through a 64 MiB fp32 device buffer. The host copy can
  /// be dropped afterwards.
  /// Errors: INVALID_ARGUMENT for dtype kF32 or weights whose tensor sizes do
  /// not match their config; RESOURCE_EXHAUSTED when device memory runs out;
  /// INTERNAL for other CUDA errors (e.g. no device).
  static absl::StatusOr<std::shared_ptr<const CudaWeights>> Upload(
      const ModelWeights& weights, CudaDType dtype = CudaDType::kBF16);

  /// Loads the checkpoint in `model_dir` (config.json + safetensors, read
  /// as LoadModelWeights reads them) to the current CUDA device as `dtype`
  /// without an fp32 copy of the model on the host: each Linear weight and
  /// the embedding table go from the mapped file to the device, copied as
  /// stored when stored in `dtype` (a bf16 checkpoint on bf16), else widened
  /// to fp32 64 MiB at a time and converted on the device; the result
  /// equals Upload(LoadModelWeights(model_dir), dtype) bit for bit. Host
  /// memory: the norms and biases, and one 64 MiB slice. Errors: those of
  /// LoadModelWeights (NOT_FOUND, INVALID_ARGUMENT naming the file and
  /// tensor) and of Upload.
  static absl::StatusOr<std::shared_ptr<const CudaWeights>> Load(
      const std::string& model_dir, CudaDType dtype = CudaDType::kBF16);

  const ModelConfig& config() const { return config_; }
  CudaDType dtype() const { return dtype_; }
  /// T [vocab, hidden].
  const void* embed() const { return embed_; }
  /// T [vocab, hidden]: embed() when tied.
  const void* lm_head() const { return lm_head_; }
  /// fp32 [hidden].
  const float* final_norm() const { return final_norm_; }
  /// double [head_dim / 2]: ComputeRopeFrequencies(config()).inv_freq.
  const double* rope_inv_freq() const { return rope_inv_freq_; }
  /// ComputeRopeFrequencies(config()).attention_factor.
  double rope_attention_factor() const { return rope_attention_factor_; }
  const CudaLayerWeights& layer(int l) const { return layers_[l]; }
  /// Device bytes held (a tied lm_head counted once).
  size_t bytes() const { return bytes_; }

 private:
  struct Preloaded;
  CudaWeights() = default;
  // Upload and Load: the model from `weights`, its Linear weights and
  // embeddings taken from `pre` where Load put them on the device.
  static absl::StatusOr<std::shared_ptr<const CudaWeights>> Assemble(
      const ModelWeights& weights, CudaDType dtype, DeviceBuffer& staging,
      Preloaded* pre);

  ModelConfig config_;
  CudaDType dtype_ = CudaDType::kBF16;
  std::vector<DeviceBuffer> buffers_;
  const void* embed_ = nullptr;
  const void* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  const double* rope_inv_freq_ = nullptr;
  double rope_attention_factor_ = 1.0;
  std::vector<CudaLayerWeights> layers_;
  size_t bytes_ = 0;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDA_WEIGHTS_H_
