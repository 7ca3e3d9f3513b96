#include "common/engine/kv_cache.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace specserve {

KvCache::KvCache(const ModelConfig& config, int capacity)
    : num_layers_(config.num_hidden_layers),
      row_width_(config.num_key_value_heads * config.head_dim),
      slots_(capacity) {
  k_.reserve(num_layers_);
  v_.reserve(num_layers_);
  const size_t n = static_cast<size_t>(capacity) * row_width_;
  for (int l = 0; l < num_layers_; ++l) {
    // Default-initialised: pages are committed only when first written.
    k_.emplace_back(new float[n]);
    v_.emplace_back(new float[n]);
  }
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(
    const ModelConfig& config, int capacity) {
  if (capacity < 1 || capacity > config.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache capacity ", capacity, " outside [1, ",
                     config.max_position_embeddings, "]"));
  }
  return std::make_unique<KvCache>(config, capacity);
}

size_t KvCache::BytesPerToken(const ModelConfig& config) {
  return 2 * sizeof(float) * static_cast<size_t>(config.num_hidden_layers) *
         config.num_key_value_heads * config.head_dim;
}

size_t KvCache::bytes_used() const {
  return 2 * sizeof(float) * static_cast<size_t>(num_layers_) * row_width_ *
         slots_.size();
}

size_t KvCache::bytes_capacity() const {
  return 2 * sizeof(float) * static_cast<size_t>(num_layers_) * row_width_ *
         slots_.capacity();
}

}  // namespace specserve
