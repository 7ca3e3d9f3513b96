#include "common/cuda/cuda_importance.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"

namespace specserve {
namespace {

// CudaImportance's buffers from `base` (null: a dry run that only sizes
// them); returns the bytes they take.
size_t CarveImportance(char* base, int prompt_len, int num_rows,
                       int num_heads, float** logits, float** running,
                       float** result) {
  const size_t plane = static_cast<size_t>(std::max(num_rows, 0)) *
                       static_cast<size_t>(std::max(prompt_len, 0));
  DeviceCarver cv(base);
  *logits = static_cast<float*>(
      cv.Take(sizeof(float) * plane * std::max(num_heads, 0)));
  *running = static_cast<float*>(cv.Take(sizeof(float) * plane));
  *result = static_cast<float*>(
      cv.Take(sizeof(float) * std::max(prompt_len, 0)));
  return cv.size();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaImportance>> CudaImportance::Create(
    int prompt_len, int num_rows, int num_heads, int num_kv_heads,
    int head_dim, int num_layers, const ScoringOptions& opts,
    cudaStream_t stream, void* scratch) {
  // The CPU accumulator's shape checks, plus the kernels'
  // head_dim limit.
  auto bad = [](const char* what, int v) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaImportance: ", what, " ", v));
  };
  if (prompt_len < 1) return bad("prompt_len must be >= 1, got", prompt_len);
  if (num_rows < 1) return bad("num_rows must be >= 1, got", num_rows);
  if (num_heads < 1) return bad("num_heads must be >= 1, got", num_heads);
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return bad("num_kv_heads must divide num_heads, got", num_kv_heads);
  }
  if (head_dim < 1 || head_dim > 256) {
    return bad("head_dim must be in [1, 256], got", head_dim);
  }
  if (num_layers < 1) return bad("num_layers must be >= 1, got", num_layers);
  SPECSERVE_RETURN_IF_ERROR(ValidateScoringOptions(opts, num_layers));

  std::unique_ptr<CudaImportance> imp(new CudaImportance());
  imp->prompt_len_ = prompt_len;
  imp->num_rows_ = num_rows;
  imp->num_heads_ = num_heads;
  imp->num_kv_heads_ = num_kv_heads;
  imp->head_dim_ = head_dim;
  imp->num_layers_ = num_layers;
  imp->opts_ = opts;
  imp->stream_ = stream;
  imp->added_.assign(num_layers, false);
  if (scratch == nullptr) {
    absl::StatusOr<DeviceBuffer> owned = DeviceBuffer::Allocate(
        ScratchBytes(prompt_len, num_rows, num_heads));
    if (!owned.ok()) return owned.status();
    imp->owned_ = *std::move(owned);
    scratch = imp->owned_.get();
  }
  CarveImportance(static_cast<char*>(scratch), prompt_len, num_rows,
                  num_heads, &imp->logits_, &imp->running_, &imp->result_);
  const size_t plane = static_cast<size_t>(num_rows) * prompt_len;
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      imp->running_, 0, sizeof(float) * plane, stream));
  return imp;
}

size_t CudaImportance::ScratchBytes(int prompt_len, int num_rows,
                                    int num_heads) {
  float *logits, *running, *result;
  return CarveImportance(nullptr, prompt_len, num_rows, num_heads, &logits,
                         &running, &result);
}

bool CudaImportance::UsesLayer(int layer) const {
  if (layer < 0 || layer >= num_layers_) return false;
  return opts_.num_layers_used == 0 ||
         layer >= num_layers_ - opts_.num_layers_used;
}

bool CudaImportance::complete() const {
  const int used =
      opts_.num_layers_used == 0 ? num_layers_ : opts_.num_layers_used;
  return layers_added_ == used;
}

absl::Status CudaImportance::AddLayer(int layer, const float* queries,
                                      const void* keys, CudaDType key_dtype,
                                      size_t key_row_stride) {
  if (absl::Status s =
          CheckAddLayerArgs(layer, num_layers_, queries, keys, key_row_stride,
                            num_kv_heads_, head_dim_);
      !s.ok()) {
    return s;
  }
  if (!UsesLayer(layer)) return absl::OkStatus();
  if (added_[layer]) {
    return absl::FailedPreconditionError(
        absl::StrCat("AddLayer: layer ", layer, " was already added"));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ImportanceLogits(
      queries, keys, key_dtype, key_row_stride, prompt_len_, num_rows_,
      num_heads_, num_kv_heads_, head_dim_, scale, logits_,
      stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ImportanceSoftmax(
      logits_, num_heads_ * num_rows_, prompt_len_, stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ImportancePoolFold(
      logits_, num_rows_, num_heads_, prompt_len_,
      opts_.pool_kernel_size,
      opts_.head_layer_aggregation == ScoringOptions::Aggregation::kMax,
      running_, stream_));
  added_[layer] = true;
  ++layers_added_;
  return absl::OkStatus();
}

float CudaImportance::FinalScale() const {
  if (opts_.head_layer_aggregation == ScoringOptions::Aggregation::kMean &&
      layers_added_ > 0) {
    return static_cast<float>(
        1.0 / (static_cast<double>(layers_added_) * num_heads_));
  }
  return 1.0f;
}

absl::StatusOr<std::vector<float>> CudaImportance::Importance() const {
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ImportanceMeanRows(
      running_, num_rows_, prompt_len_, FinalScale(),
      result_, stream_));
  std::vector<float> host(prompt_len_);
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), result_, sizeof(float) * prompt_len_,
                      cudaMemcpyDeviceToHost, stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return host;
}

absl::StatusOr<std::vector<std::vector<float>>>
CudaImportance::PerRowImportance() const {
  const size_t plane = static_cast<size_t>(num_rows_) * prompt_len_;
  std::vector<float> flat(plane);
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(flat.data(), running_, sizeof(float) * plane,
                      cudaMemcpyDeviceToHost, stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const float scale = FinalScale();
  std::vector<std::vector<float>> out(num_rows_,
                                      std::vector<float>(prompt_len_));
  for (int r = 0; r < num_rows_; ++r) {
    for (int j = 0; j < prompt_len_; ++j) {
      out[r][j] = flat[static_cast<size_t>(r) * prompt_len_ + j] * scale;
    }
  }
  return out;
}

}  // namespace specserve
