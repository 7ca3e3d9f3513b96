#ifndef SPECSERVE_COMMON_CUDA_CUDA_IMPORTANCE_H_
#define SPECSERVE_COMMON_CUDA_CUDA_IMPORTANCE_H_

// Speculative Prefill token-importance scoring on the device (Liu, Chen,
// Zhang, ICML 2025, arXiv 2502.02789, section 3.2; docs/ARCHITECTURE.md,
// Speculative Prefill steps 3-5): the device twin of ImportanceAccumulator
// (common/specprefill/importance.h), which is its reference. Per layer:
// q.k / sqrt(head_dim) of every scoring row against the PROMPT keys, softmax
// over the prompt (fp32), avg_pool1d(count_include_pad), max (or sum) over
// layers x heads into a running [rows, prompt_len] buffer; at the end the
// mean over rows. Only prompt_len floats come back to the host.

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/specprefill/importance.h"

namespace specserve {

/// Accumulates per-token importance layer by layer on the device. Memory:
/// logits fp32 [heads, rows, prompt_len] (reused per layer; 38 MB at 32
/// heads, 9 rows, 32K tokens) plus the running [rows, prompt_len].
/// Not thread-safe; all work is enqueued on `stream` (null = the legacy
/// default stream).
class CudaImportance {
 public:
  /// Shapes as ImportanceAccumulator: `prompt_len` keys, `num_rows` scoring
  /// rows, `num_heads` query heads over `num_kv_heads` kv heads
  /// (num_heads % num_kv_heads == 0), `head_dim` <= 256, `num_layers`.
  /// `scratch`: null, and the buffers are allocated (and freed) with the
  /// object; or device memory of at least ScratchBytes(prompt_len,
  /// num_rows, num_heads) bytes, 256-byte aligned, that the caller keeps
  /// until the object is gone and uses for nothing else meanwhile (a
  /// runner's step workspace: no cudaMalloc / cudaFree per prompt, and
  /// cudaFree waits for the whole device).
  /// Errors: INVALID_ARGUMENT naming the argument or ScoringOptions field;
  /// RESOURCE_EXHAUSTED / INTERNAL from cudaMalloc.
  static absl::StatusOr<std::unique_ptr<CudaImportance>> Create(
      int prompt_len, int num_rows, int num_heads, int num_kv_heads,
      int head_dim, int num_layers, const ScoringOptions& opts,
      cudaStream_t stream = nullptr, void* scratch = nullptr);

  /// Bytes of device memory the buffers take: logits fp32 [heads, rows,
  /// prompt_len], running fp32 [rows, prompt_len] and the result fp32
  /// [prompt_len], each from a 256-byte boundary.
  static size_t ScratchBytes(int prompt_len, int num_rows, int num_heads);

  /// Whether layer `layer` contributes (ScoringOptions::num_layers_used).
  bool UsesLayer(int layer) const;

  /// Folds one layer in (enqueued, not synchronised).
  /// `queries`: device fp32 [num_rows, num_heads, head_dim] post-RoPE queries
  ///   of the scoring rows at this layer.
  /// `keys`: device, `key_dtype`; prompt token i's [num_kv_heads, head_dim]
  ///   at keys + i * key_row_stride ELEMENTS (a CudaModelRunner K plane with
  ///   the KV row width as the stride). Only the first prompt_len rows are
  ///   read.
  /// Errors as ImportanceAccumulator::AddLayer: INVALID_ARGUMENT for a layer
  /// outside [0, num_layers), null pointers or key_row_stride <
  /// num_kv_heads * head_dim; FAILED_PRECONDITION if the layer was already
  /// added; INTERNAL for launch failures. Unused layers return OK.
  absl::Status AddLayer(int layer, const float* queries, const void* keys,
                        CudaDType key_dtype, size_t key_row_stride);

  int layers_added() const { return layers_added_; }
  bool complete() const;

  /// Importance fp32 [prompt_len] on the host: the max (kMax) or mean
  /// (kMean) over the added layers x heads, averaged over rows. All zeros
  /// before any layer. Synchronises the stream; CUDA errors as INTERNAL.
  absl::StatusOr<std::vector<float>> Importance() const;

  /// Per-row importance [num_rows][prompt_len] on the host (tests).
  absl::StatusOr<std::vector<std::vector<float>>> PerRowImportance() const;

 private:
  CudaImportance() = default;
  float FinalScale() const;

  int prompt_len_ = 0;
  int num_rows_ = 0;
  int num_heads_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  int num_layers_ = 0;
  ScoringOptions opts_;
  cudaStream_t stream_ = nullptr;
  int layers_added_ = 0;
  std::vector<bool> added_;
  DeviceBuffer owned_;  // the buffers below, unless the caller's scratch
  float* logits_ = nullptr;   // fp32 [heads, rows, prompt_len]
  float* running_ = nullptr;  // fp32 [rows, prompt_len]
  float* result_ = nullptr;   // fp32 [prompt_len]
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDA_IMPORTANCE_H_
