#include "common/cuda/cuda_kv_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"

namespace specserve {

absl::StatusOr<std::unique_ptr<CudaKvCache>> CudaKvCache::Create(
    const ModelConfig& config, int capacity, CudaDType dtype) {
  if (capacity < 1 || capacity > config.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache capacity ", capacity, " outside [1, ",
                     config.max_position_embeddings, "]"));
  }
  std::unique_ptr<CudaKvCache> cache(new CudaKvCache());
  cache->num_layers_ = config.num_hidden_layers;
  cache->row_width_ = config.num_key_value_heads * config.head_dim;
  cache->slots_ = KvSlots(capacity);
  cache->dtype_ = dtype;
  absl::StatusOr<DeviceBuffer> storage =
      DeviceBuffer::Allocate(cache->bytes_capacity());
  if (!storage.ok()) return storage.status();
  cache->storage_ = *std::move(storage);
  return cache;
}

void* CudaKvCache::keys(int layer) const {
  const size_t plane =
      static_cast<size_t>(capacity()) * row_width_ * CudaDTypeBytes(dtype_);
  return storage_.as<char>() + (2 * static_cast<size_t>(layer)) * plane;
}

void* CudaKvCache::values(int layer) const {
  const size_t plane =
      static_cast<size_t>(capacity()) * row_width_ * CudaDTypeBytes(dtype_);
  return storage_.as<char>() + (2 * static_cast<size_t>(layer) + 1) * plane;
}

absl::StatusOr<std::vector<float>> CudaKvCache::CopyPlaneToHost(
    const void* plane) const {
  const size_t count = static_cast<size_t>(size()) * row_width_;
  std::vector<float> host(count);
  if (count == 0) return host;
  absl::StatusOr<DeviceBuffer> tmp =
      DeviceBuffer::Allocate(count * sizeof(float));
  if (!tmp.ok()) return tmp.status();
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ConvertToF32(
      plane, dtype_, tmp->as<float>(), count, /*stream=*/nullptr));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), tmp->get(),
                                            count * sizeof(float),
                                            cudaMemcpyDeviceToHost));
  return host;
}

absl::StatusOr<std::vector<float>> CudaKvCache::CopyKeysToHost(
    int layer) const {
  if (layer < 0 || layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", num_layers_, ")"));
  }
  return CopyPlaneToHost(keys(layer));
}

absl::StatusOr<std::vector<float>> CudaKvCache::CopyValuesToHost(
    int layer) const {
  if (layer < 0 || layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", num_layers_, ")"));
  }
  return CopyPlaneToHost(values(layer));
}

size_t CudaKvCache::BytesPerToken(const ModelConfig& config, CudaDType dtype) {
  return 2 * CudaDTypeBytes(dtype) *
         static_cast<size_t>(config.num_hidden_layers) *
         config.num_key_value_heads * config.head_dim;
}

size_t CudaKvCache::bytes_used() const {
  return 2 * CudaDTypeBytes(dtype_) * static_cast<size_t>(num_layers_) *
         row_width_ * size();
}

size_t CudaKvCache::bytes_capacity() const {
  return 2 * CudaDTypeBytes(dtype_) * static_cast<size_t>(num_layers_) *
         row_width_ * capacity();
}

}  // namespace specserve
