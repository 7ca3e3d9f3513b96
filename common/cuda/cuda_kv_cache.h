#ifndef SPECSERVE_COMMON_CUDA_CUDA_KV_CACHE_H_
#define SPECSERVE_COMMON_CUDA_CUDA_KV_CACHE_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/engine/kv_slots.h"
#include "common/model/config.h"

namespace specserve {

/// Per-sequence key/value cache on the device, with the semantics of the
/// CPU KvCache (common/engine/kv_cache.h): for every layer, post-RoPE keys
/// and values as T [capacity, num_kv_heads, head_dim] token-major, plus the
/// position id each cached token was rotated with (kept on the host:
/// positions need not be contiguous, Speculative Prefill caches only the
/// kept prompt tokens at their original positions). Reserve / Truncate /
/// Clear only move the size; rolling back rejected drafts costs nothing.
///
/// Unlike the CPU cache, the full capacity is allocated up front (one
/// cudaMalloc), so Create fails early when the device is out of memory.
class CudaKvCache {
 public:
  /// `capacity` tokens, elements of `dtype` (kBF16 / kFP16 like the weights;
  /// kF32 is accepted). Errors: INVALID_ARGUMENT if capacity < 1 or >
  /// max_position_embeddings; RESOURCE_EXHAUSTED when device memory runs
  /// out; INTERNAL for other CUDA errors.
  static absl::StatusOr<std::unique_ptr<CudaKvCache>> Create(
      const ModelConfig& config, int capacity,
      CudaDType dtype = CudaDType::kBF16);

  /// Number of cached tokens.
  int size() const { return slots_.size(); }
  int capacity() const { return slots_.capacity(); }
  int num_layers() const { return num_layers_; }
  CudaDType dtype() const { return dtype_; }
  /// Elements per cached token per layer for K (== for V): kv_heads *
  /// head_dim.
  int row_width() const { return row_width_; }

  /// Reserves `n` more slots and returns the first. RESOURCE_EXHAUSTED (and
  /// nothing changes) when size + n > capacity or n < 0.
  absl::StatusOr<int> Reserve(int n) { return slots_.Reserve(n); }
  /// Records the position ids of slots [first, first + n) after Reserve.
  void SetPositions(int first, const int* positions, int n) {
    slots_.SetPositions(first, positions, n);
  }
  /// Rolls back to the first `n` tokens (rejected drafts). INVALID_ARGUMENT
  /// if n < 0 or n > size().
  absl::Status Truncate(int n) { return slots_.Truncate(n); }
  /// Drops everything.
  void Clear() { slots_.Clear(); }

  /// Device pointer to layer `layer`'s keys: T [capacity, kv_heads,
  /// head_dim]; slot i at keys(layer) + i * row_width() elements.
  void* keys(int layer) const;
  void* values(int layer) const;
  /// Position id of each cached token, [size()].
  const std::vector<int>& positions() const { return slots_.positions(); }
  /// Position of the last cached token, or -1 when empty.
  int last_position() const { return slots_.last_position(); }

  /// Copies slots [0, size()) of layer `layer`'s keys (or values) to the
  /// host as fp32 [size(), kv_heads, head_dim] (for tests and debugging;
  /// synchronous). INVALID_ARGUMENT for a bad layer; CUDA errors as INTERNAL.
  absl::StatusOr<std::vector<float>> CopyKeysToHost(int layer) const;
  absl::StatusOr<std::vector<float>> CopyValuesToHost(int layer) const;

  /// Bytes of K and V for the cached tokens.
  size_t bytes_used() const;
  /// Bytes of K and V at full capacity (what is allocated).
  size_t bytes_capacity() const;
  /// Bytes one token costs across all layers (K and V) at `dtype`.
  static size_t BytesPerToken(const ModelConfig& config, CudaDType dtype);

 private:
  CudaKvCache() = default;
  absl::StatusOr<std::vector<float>> CopyPlaneToHost(const void* plane) const;

  int num_layers_ = 0;
  int row_width_ = 0;
  KvSlots slots_{0};
  CudaDType dtype_ = CudaDType::kBF16;
  DeviceBuffer storage_;  // [layers][K, V][capacity][row_width]
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDA_KV_CACHE_H_
