#ifndef SPECSERVE_COMMON_ENGINE_KV_CACHE_H_
#define SPECSERVE_COMMON_ENGINE_KV_CACHE_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/engine/kv_slots.h"
#include "common/model/config.h"

namespace specserve {

/// Per-sequence key/value cache of a Llama model (llama.cpp's
/// `llama-kv-cache`, one sequence). For every layer it stores post-RoPE keys
/// and values as [capacity, num_kv_heads, head_dim] fp32, token-major, plus
/// the position id each cached token was rotated with. Positions need not be
/// contiguous: Speculative Prefill caches only the kept prompt tokens, each
/// at its original position.
///
/// Memory is reserved as address space up front but only the pages of cached
/// tokens are touched, so `bytes_used()` grows with `size()`.
class KvCache {
 public:
  /// `capacity`: maximum cached tokens (>= 1). Use `Create` to validate.
  KvCache(const ModelConfig& config, int capacity);

  /// INVALID_ARGUMENT if capacity < 1 or > the model's max context.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const ModelConfig& config, int capacity);

  /// Number of cached tokens.
  int size() const { return slots_.size(); }
  int capacity() const { return slots_.capacity(); }
  int num_layers() const { return num_layers_; }
  /// Floats per cached token per layer for K (== for V): kv_heads * head_dim.
  int row_width() const { return row_width_; }

  /// Reserves `n` more slots for a forward pass and returns the first slot.
  /// RESOURCE_EXHAUSTED (and nothing changes) when size + n > capacity.
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

  /// Keys of `layer`: [capacity, kv_heads, head_dim]; row i at
  /// keys(layer) + i * row_width(). Valid rows are [0, size()).
  float* keys(int layer) { return k_[layer].get(); }
  const float* keys(int layer) const { return k_[layer].get(); }
  float* values(int layer) { return v_[layer].get(); }
  const float* values(int layer) const { return v_[layer].get(); }
  /// Position id of each cached token, [size()].
  const std::vector<int>& positions() const { return slots_.positions(); }
  /// Position of the last cached token, or -1 when empty.
  int last_position() const { return slots_.last_position(); }

  /// Bytes of K and V for the cached tokens (what the session costs).
  size_t bytes_used() const;
  /// Bytes of K and V at full capacity.
  size_t bytes_capacity() const;
  /// Bytes one token costs across all layers (K and V).
  static size_t BytesPerToken(const ModelConfig& config);

 private:
  int num_layers_;
  int row_width_;
  KvSlots slots_;
  std::vector<std::unique_ptr<float[]>> k_;
  std::vector<std::unique_ptr<float[]>> v_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_KV_CACHE_H_
