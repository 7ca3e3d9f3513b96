#ifndef SPECSERVE_COMMON_CUDA_CUDA_TRANSFORMER_H_
#define SPECSERVE_COMMON_CUDA_CUDA_TRANSFORMER_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_kv_cache.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/device_buffer.h"
#include "common/engine/transformer.h"

namespace specserve {

/// Post-RoPE queries of Speculative Prefill's scoring rows, kept on the
/// device across forward passes (the last prompt row from the prefill, then
/// one row per look-ahead decode step) so that CudaImportance can score
/// them without a round trip through the host.
class CudaQueryCapture {
 public:
  /// Room for `max_rows` rows of a model with `config`'s shape.
  /// INVALID_ARGUMENT if max_rows < 1; RESOURCE_EXHAUSTED / INTERNAL from
  /// cudaMalloc.
  static absl::StatusOr<std::unique_ptr<CudaQueryCapture>> Create(
      const ModelConfig& config, int max_rows);

  /// Rows captured so far, in capture order.
  int rows() const { return rows_; }
  int max_rows() const { return max_rows_; }
  int num_layers() const { return num_layers_; }
  int num_heads() const { return num_heads_; }
  int head_dim() const { return head_dim_; }
  /// Device fp32 [max_rows, num_heads, head_dim] of layer `layer`; rows
  /// [0, rows()) are valid.
  const float* layer_queries(int layer) const;
  /// Forgets every captured row.
  void Clear() { rows_ = 0; }
  /// Host copy, fp32 [num_layers, rows(), num_heads, head_dim] (the layout
  /// of ForwardOutput::queries). Synchronous; CUDA errors as INTERNAL.
  absl::StatusOr<std::vector<float>> CopyToHost() const;

 private:
  friend class CudaTransformer;
  CudaQueryCapture() = default;
  float* mutable_layer_queries(int layer) const;

  int rows_ = 0;
  int max_rows_ = 0;
  int num_layers_ = 0;
  int num_heads_ = 0;
  int head_dim_ = 0;
  DeviceBuffer storage_;  // [layers][max_rows][heads][head_dim]
};

/// CUDA Llama forward with the semantics of the CPU Transformer
/// (common/engine/transformer.h; HF LlamaForCausalLM): embedding gather,
/// RMSNorm, rotate_half RoPE at explicit position ids, grouped-query causal
/// attention over the cached + new tokens (FlashAttention-style tensor-core
/// kernel for prefill batches, split-K kernel for decode / verify rows), SiLU-
/// gated MLP, final norm and lm_head for the requested rows only.
///
/// Precision: weights, KV cache and GEMM inputs are the weights' dtype (bf16
/// or fp16); every GEMM accumulates in fp32 (cuBLAS, CUBLAS_COMPUTE_32F); the
/// residual stream, norms, RoPE, softmax and logits are fp32.
///
/// One instance owns a CUDA stream, a cuBLAS handle and a device workspace
/// that grows to the largest batch seen. Forward calls are serialised by a
/// mutex (the GPU runs one at a time anyway); each sequence has its own
/// CudaKvCache. Construct on the device that will run it (the current
/// device).
class CudaTransformer {
 public:
  /// Which attention kernel Forward uses. kAuto: FlashAttention for batches
  /// of >= kFlashMinRows rows when the head_dim / dtype are supported,
  /// split-K otherwise. The others force one (tests, benchmarks); kFlash
  /// falls back to split-K where FlashAttention is unsupported.
  enum class AttentionPath { kAuto, kFlash, kSplitK };
  static constexpr int kFlashMinRows = 32;

  /// Creates the stream and cuBLAS handle. INTERNAL when CUDA or cuBLAS
  /// cannot start (no device included).
  static absl::StatusOr<std::unique_ptr<CudaTransformer>> Create(
      std::shared_ptr<const CudaWeights> weights);
  ~CudaTransformer();
  CudaTransformer(const CudaTransformer&) = delete;
  CudaTransformer& operator=(const CudaTransformer&) = delete;

  const ModelConfig& config() const { return weights_->config(); }
  const CudaWeights& weights() const { return *weights_; }
  /// The stream every kernel of Forward runs on.
  cudaStream_t stream() const { return stream_; }
  /// Multiprocessors of the device (sizes the split-K grid).
  int num_sms() const { return num_sms_; }

  void set_attention_path(AttentionPath path);

  /// Runs `in` after the tokens already in `cache`, appends their keys and
  /// values to it and fills `out` exactly as Transformer::Forward does
  /// (logits fp32 [logit_rows, vocab] copied to the host for the requested
  /// rows only; queries fp32 [layers, capture rows, heads, head_dim]).
  /// With `capture` non-null the captured queries are appended to it on the
  /// device instead and out->queries is left empty.
  /// Synchronous: returns when the results are on the host.
  /// Errors (nothing is appended to the cache or the capture):
  /// INVALID_ARGUMENT for an empty batch, mismatched lengths, a token id
  /// outside the vocabulary, a position outside [0, max_position_embeddings),
  /// a row outside [0, n), a cache or capture of another shape or dtype;
  /// RESOURCE_EXHAUSTED when the cache or capture is full or device memory
  /// runs out; INTERNAL for CUDA / cuBLAS failures.
  absl::Status Forward(const ForwardInput& in, CudaKvCache* cache,
                       ForwardOutput* out,
                       CudaQueryCapture* capture = nullptr) const;

 private:
  CudaTransformer(std::shared_ptr<const CudaWeights> weights,
                  cudaStream_t stream, cublasHandle_t cublas, int num_sms);

  absl::Status Run(const ForwardInput& in, const std::vector<int>& logit_rows,
                   int first, CudaKvCache* cache, ForwardOutput* out,
                   CudaQueryCapture* capture) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::shared_ptr<const CudaWeights> weights_;
  cudaStream_t stream_;
  cublasHandle_t cublas_;
  int num_sms_;
  mutable absl::Mutex mu_;
  AttentionPath attention_path_ ABSL_GUARDED_BY(mu_) = AttentionPath::kAuto;
  mutable DeviceBuffer workspace_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDA_TRANSFORMER_H_
