#include "common/engine/model_runner_factory.h"

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_model_runner.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/device.h"

namespace specserve {
namespace {

absl::StatusOr<CudaDType> ParseCudaDType(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return CudaDType::kBF16;
  if (s == "fp16" || s == "float16") return CudaDType::kFP16;
  return absl::InvalidArgumentError(
      absl::StrCat("cuda_dtype must be bf16 or fp16, got \"", s, "\""));
}

}  // namespace

int DefaultMaxNumBatchedTokens(const ModelRunner& runner, int requested) {
  if (requested > 0) return requested;
  return runner.backend() == "cuda" ? 2048 : 512;
}

absl::StatusOr<size_t> KvBytesPerToken(const ModelConfig& config,
                                       const RunnerOptions& options) {
  absl::StatusOr<DeviceKind> kind =
      ParseDevice(options.device, CudaAvailable());
  if (!kind.ok()) return kind.status();
  if (*kind == DeviceKind::kCpu) return CpuModelRunner::BytesPerToken(config);
  absl::StatusOr<CudaDType> dt = ParseCudaDType(options.cuda_dtype);
  if (!dt.ok()) return dt.status();
  return CudaModelRunner::BytesPerToken(config, *dt);
}

namespace {

// The CUDA path of CreateModelRunner.
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(
    const ModelWeights& weights, const RunnerOptions& options) {
  absl::StatusOr<CudaDType> dt = ParseCudaDType(options.cuda_dtype);
  if (!dt.ok()) return dt.status();
  absl::StatusOr<std::shared_ptr<const CudaWeights>> gw =
      CudaWeights::Upload(weights, *dt);
  if (!gw.ok()) return gw.status();
  absl::StatusOr<std::unique_ptr<CudaModelRunner>> r =
      CudaModelRunner::Create(*std::move(gw), options.kv_cache);
  if (!r.ok()) return r.status();
  return std::unique_ptr<ModelRunner>(*std::move(r));
}

// The device and, for cpu, the weight dtype `options` ask for.
absl::StatusOr<DeviceKind> ResolveDevice(
    const RunnerOptions& options, std::optional<WeightDType>* weight_dtype) {
  absl::StatusOr<DeviceKind> kind =
      ParseDevice(options.device, CudaAvailable());
  if (!kind.ok()) return kind.status();
  absl::StatusOr<std::optional<WeightDType>> wt =
      ParseWeightDType(options.weight_dtype);
  if (!wt.ok()) return wt.status();
  if (*kind != DeviceKind::kCpu && wt->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_dtype \"", options.weight_dtype,
        "\" is for the CPU engine; on cuda use cuda_dtype"));
  }
  *weight_dtype = *wt;
  return kind;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    std::shared_ptr<const ModelWeights> weights, const RunnerOptions& options) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CreateModelRunner: weights is null");
  }
  std::optional<WeightDType> wt;
  absl::StatusOr<DeviceKind> kind = ResolveDevice(options, &wt);
  if (!kind.ok()) return kind.status();
  if (*kind == DeviceKind::kCpu) {
    absl::StatusOr<std::unique_ptr<CpuModelRunner>> r =
        CpuModelRunner::Create(std::move(weights), options.kv_cache, wt);
    if (!r.ok()) return r.status();
    return std::unique_ptr<ModelRunner>(*std::move(r));
  }
  return CreateCudaRunner(*weights, options);
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    ModelWeights&& weights, const RunnerOptions& options) {
  std::optional<WeightDType> wt;
  absl::StatusOr<DeviceKind> kind = ResolveDevice(options, &wt);
  if (!kind.ok()) return kind.status();
  if (*kind == DeviceKind::kCpu) {
    absl::StatusOr<std::unique_ptr<CpuModelRunner>> r =
        CpuModelRunner::Create(std::move(weights), options.kv_cache, wt);
    if (!r.ok()) return r.status();
    return std::unique_ptr<ModelRunner>(*std::move(r));
  }
  return CreateCudaRunner(weights, options);
}

absl::StatusOr<std::unique_ptr<ModelRunner>> LoadModelRunner(
    const std::string& model_dir, const RunnerOptions& options) {
  std::optional<WeightDType> wt;
  absl::StatusOr<DeviceKind> kind = ResolveDevice(options, &wt);
  if (!kind.ok()) return kind.status();
  if (*kind == DeviceKind::kCpu) {
    absl::StatusOr<std::unique_ptr<CpuModelRunner>> r =
        CpuModelRunner::Load(model_dir, options.kv_cache, wt);
    if (!r.ok()) return r.status();
    return std::unique_ptr<ModelRunner>(*std::move(r));
  }
  absl::StatusOr<ModelWeights> w = LoadModelWeights(model_dir);
  if (!w.ok()) return w.status();
  return CreateCudaRunner(*w, options);
}

}  // namespace specserve
