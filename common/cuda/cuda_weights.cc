#include "common/cuda/cuda_weights.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/model/rope.h"

namespace specserve {
namespace {

constexpr size_t kStagingFloats = size_t{16} << 20;  // 64 MiB

// Copies `src` to a new device buffer as `dtype` (fp32 stays fp32), through
// the fp32 staging buffer. Synchronous.
absl::StatusOr<DeviceBuffer> UploadTensor(const std::vector<float>& src,
                                          size_t expected, CudaDType dtype,
                                          DeviceBuffer& staging,
                                          const std::string& name) {
  if (src.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaWeights: tensor ", name, " has ", src.size(),
                     " elements, the config implies ", expected));
  }
  absl::StatusOr<DeviceBuffer> buf =
      DeviceBuffer::Allocate(src.size() * CudaDTypeBytes(dtype));
  if (!buf.ok()) return buf.status();
  if (dtype == CudaDType::kF32) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(
        buf->get(), src.data(), src.size() * sizeof(float),
        cudaMemcpyHostToDevice));
    return buf;
  }
  for (size_t off = 0; off < src.size(); off += kStagingFloats) {
    const size_t count = std::min(kStagingFloats, src.size() - off);
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(staging.get(), src.data() + off,
                                              count * sizeof(float),
                                              cudaMemcpyHostToDevice));
    char* dst = buf->as<char>() + off * CudaDTypeBytes(dtype);
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ConvertFromF32(
        staging.as<float>(), dst, dtype, count, /*stream=*/nullptr));
  }
  // The staging buffer is reused by the next tensor: wait for the
  // conversions (legacy default stream, ordered after the copies).
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return buf;
}

// True when a tensor stored as `stored` is already in the device's `dtype`.
bool SameBits(DType stored, CudaDType dtype) {
  return (stored == DType::kBF16 && dtype == CudaDType::kBF16) ||
         (stored == DType::kF16 && dtype == CudaDType::kFP16);
}

// Copies the Linear weight `v` (in the mapped checkpoint) to a new device
// buffer as `dtype`: a block stored in `dtype` as is, any other widened to
// fp32 on the host a staging buffer's worth at a time and converted on the
// device. Synchronous.
absl::StatusOr<DeviceBuffer> UploadView(const LinearView& v, size_t expected,
                                        CudaDType dtype, DeviceBuffer& staging,
                                        const std::string& name) {
  const size_t cols = static_cast<size_t>(v.cols);
  const size_t rows = static_cast<size_t>(v.rows());
  if (rows * cols != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaWeights: tensor ", name, " has ", rows * cols,
                     " elements, the config implies ", expected));
  }
  const size_t width = CudaDTypeBytes(dtype);
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(expected * width);
  if (!buf.ok()) return buf.status();
  char* dst = buf->as<char>();
  std::vector<float> host;
  for (const RawTensor& b : v.blocks) {
    if (SameBits(b.dtype, dtype)) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          dst, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice));
      dst += b.bytes.size();
      continue;
    }
    const size_t stored = DTypeSize(b.dtype);
    const size_t n = b.bytes.size() / stored;
    for (size_t off = 0; off < n; off += kStagingFloats) {
      const size_t count = std::min(kStagingFloats, n - off);
      host.resize(count);
      ConvertToFloat(b.bytes.data() + off * stored, b.dtype, count,
                     host.data());
      SPECSERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(staging.get(), host.data(), count * sizeof(float),
                     cudaMemcpyHostToDevice));
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ConvertFromF32(
          staging.as<float>(), dst, dtype, count, /*stream=*/nullptr));
      dst += count * width;
      // `host` and `staging` are reused next: wait for the conversion.
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    }
  }
  return buf;
}

// The fp32 staging buffer Upload and Load convert through, for `dtype`
// (INVALID_ARGUMENT for kF32: the device holds bf16 or fp16 weights).
absl::StatusOr<DeviceBuffer> StagingFor(CudaDType dtype) {
  if (dtype == CudaDType::kF32) {
    return absl::InvalidArgumentError(
        "CudaWeights: dtype must be bf16 or fp16, got f32");
  }
  return DeviceBuffer::Allocate(kStagingFloats * sizeof(float));
}

}  // namespace

// The Linear weights and embeddings Load has already put on the device.
struct CudaWeights::Preloaded {
  std::optional<DeviceBuffer> embed, lm_head;  // lm_head empty when tied
  struct Layer {
    std::optional<DeviceBuffer> wqkv, wo, w_gate_up, w_down;
  };
  std::vector<Layer> layers;
};

absl::StatusOr<std::shared_ptr<const CudaWeights>> CudaWeights::Upload(
    const ModelWeights& weights, CudaDType dtype) {
  // Before any device allocation: hosts without a GPU see these errors.
  if (static_cast<int>(weights.layers.size()) !=
      weights.config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaWeights: ", weights.layers.size(), " layers, config has ",
        weights.config.num_hidden_layers));
  }
  absl::StatusOr<DeviceBuffer> staging = StagingFor(dtype);
  if (!staging.ok()) return staging.status();
  return Assemble(weights, dtype, *staging, nullptr);
}

absl::StatusOr<std::shared_ptr<const CudaWeights>> CudaWeights::Load(
    const std::string& model_dir, CudaDType dtype) {
  absl::StatusOr<DeviceBuffer> staging = StagingFor(dtype);
  if (!staging.ok()) return staging.status();
  Preloaded pre;
  LoadWeightsOptions lo;
  lo.on_embeddings = [&](const ModelWeights& partial, const LinearView& e,
                         const LinearView* head) -> absl::Status {
    const size_t n = static_cast<size_t>(partial.config.vocab_size) *
                     partial.config.hidden_size;
    absl::StatusOr<DeviceBuffer> b =
        UploadView(e, n, dtype, *staging, "embed");
    if (!b.ok()) return b.status();
    pre.embed = *std::move(b);
    if (head != nullptr) {
      b = UploadView(*head, n, dtype, *staging, "lm_head");
      if (!b.ok()) return b.status();
      pre.lm_head = *std::move(b);
    }
    return absl::OkStatus();
  };
  lo.on_linear_layer = [&](const ModelWeights& partial, int l,
                           const LayerLinearViews& v) -> absl::Status {
    const ModelConfig& c = partial.config;
    const size_t hidden = c.hidden_size, ffn = c.intermediate_size;
    const size_t qd = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
    const std::string p = absl::StrCat("layers.", l, ".");
    pre.layers.resize(c.num_hidden_layers);
    Preloaded::Layer& d = pre.layers[l];
    const struct {
      const LinearView& view;
      size_t n;
      const char* name;
      std::optional<DeviceBuffer>* dst;
    } parts[] = {
        {v.wqkv, static_cast<size_t>(c.qkv_dim()) * hidden, "wqkv", &d.wqkv},
        {v.wo, hidden * qd, "wo", &d.wo},
        {v.w_gate_up, 2 * ffn * hidden, "w_gate_up", &d.w_gate_up},
        {v.w_down, hidden * ffn, "w_down", &d.w_down},
    };
    for (const auto& part : parts) {
      absl::StatusOr<DeviceBuffer> b =
          UploadView(part.view, part.n, dtype, *staging, p + part.name);
      if (!b.ok()) return b.status();
      *part.dst = *std::move(b);
    }
    return absl::OkStatus();
  };
  absl::StatusOr<ModelWeights> w = LoadModelWeights(model_dir, lo);
  if (!w.ok()) return w.status();
  return Assemble(*w, dtype, *staging, &pre);
}

absl::StatusOr<std::shared_ptr<const CudaWeights>> CudaWeights::Assemble(
    const ModelWeights& weights, CudaDType dtype, DeviceBuffer& staging_buf,
    Preloaded* pre) {
  const ModelConfig& c = weights.config;
  // Upload checked `weights`; Load's loader called on_linear_layer per layer.
  if (pre != nullptr &&
      static_cast<int>(pre->layers.size()) != c.num_hidden_layers) {
    return absl::InternalError(absl::StrCat(
        "CudaWeights: ", pre->layers.size(), " layers loaded, config has ",
        c.num_hidden_layers));
  }
  std::shared_ptr<CudaWeights> out(new CudaWeights());
  out->config_ = c;
  out->dtype_ = dtype;
  DeviceBuffer* staging = &staging_buf;

  const size_t hidden = c.hidden_size, ffn = c.intermediate_size;
  const size_t vocab = c.vocab_size;
  const size_t qd = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  // A Linear weight: the buffer Load made (`ready`), else from `src`.
  auto add = [&](const std::vector<float>& src, size_t expected,
                 CudaDType dt, const std::string& name, const void** dst,
                 std::optional<DeviceBuffer>* ready =
                     nullptr) -> absl::Status {
    absl::StatusOr<DeviceBuffer> buf =
        ready != nullptr && ready->has_value()
            ? absl::StatusOr<DeviceBuffer>(std::move(**ready))
            : UploadTensor(src, expected, dt, *staging, name);
    if (!buf.ok()) return buf.status();
    *dst = buf->get();
    out->bytes_ += buf->bytes();
    out->buffers_.push_back(*std::move(buf));
    return absl::OkStatus();
  };
  auto add_f32 = [&](const std::vector<float>& src, size_t expected,
                     const std::string& name,
                     const float** dst) -> absl::Status {
    const void* p = nullptr;
    SPECSERVE_RETURN_IF_ERROR(add(src, expected, CudaDType::kF32, name, &p));
    *dst = static_cast<const float*>(p);
    return absl::OkStatus();
  };

  SPECSERVE_RETURN_IF_ERROR(add(weights.embed, vocab * hidden, dtype,
                                "embed", &out->embed_,
                                pre != nullptr ? &pre->embed : nullptr));
  const bool tied = pre != nullptr ? !pre->lm_head.has_value()
                                   : weights.lm_head_weight.empty();
  if (tied) {
    out->lm_head_ = out->embed_;
  } else {
    SPECSERVE_RETURN_IF_ERROR(add(weights.lm_head_weight, vocab * hidden,
                                  dtype, "lm_head", &out->lm_head_,
                                  pre != nullptr ? &pre->lm_head : nullptr));
  }
  SPECSERVE_RETURN_IF_ERROR(
      add_f32(weights.final_norm, hidden, "final_norm", &out->final_norm_));
  // RoPE frequencies (rope_scaling applied), in double as the CPU uses.
  const RopeFrequencies rope = ComputeRopeFrequencies(c);
  {
    const size_t bytes = rope.inv_freq.size() * sizeof(double);
    absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(bytes);
    if (!buf.ok()) return buf.status();
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(
        buf->get(), rope.inv_freq.data(), bytes, cudaMemcpyHostToDevice));
    out->rope_inv_freq_ = buf->as<double>();
    out->rope_attention_factor_ = rope.attention_factor;
    out->bytes_ += buf->bytes();
    out->buffers_.push_back(*std::move(buf));
  }
  const size_t head_dim = c.head_dim;
  out->layers_.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = weights.layers[l];
    CudaLayerWeights& d = out->layers_[l];
    Preloaded::Layer* ready = pre != nullptr ? &pre->layers[l] : nullptr;
    const std::string p = absl::StrCat("layers.", l, ".");
    SPECSERVE_RETURN_IF_ERROR(
        add_f32(w.attn_norm, hidden, p + "attn_norm", &d.attn_norm));
    SPECSERVE_RETURN_IF_ERROR(add(w.wqkv,
                                  static_cast<size_t>(c.qkv_dim()) * hidden,
                                  dtype, p + "wqkv", &d.wqkv,
                                  ready ? &ready->wqkv : nullptr));
    SPECSERVE_RETURN_IF_ERROR(add(w.wo, hidden * qd, dtype, p + "wo", &d.wo,
                                  ready ? &ready->wo : nullptr));
    SPECSERVE_RETURN_IF_ERROR(
        add_f32(w.mlp_norm, hidden, p + "mlp_norm", &d.mlp_norm));
    SPECSERVE_RETURN_IF_ERROR(add(w.w_gate_up, 2 * ffn * hidden, dtype,
                                  p + "w_gate_up", &d.w_gate_up,
                                  ready ? &ready->w_gate_up : nullptr));
    SPECSERVE_RETURN_IF_ERROR(add(w.w_down, hidden * ffn, dtype,
                                  p + "w_down", &d.w_down,
                                  ready ? &ready->w_down : nullptr));
    // Optional per-architecture tensors: present iff the config implies
    // them (LoadModelWeights' contract); sizes checked by UploadTensor.
    if (c.has_qkv_bias()) {
      SPECSERVE_RETURN_IF_ERROR(add_f32(
          w.bqkv, static_cast<size_t>(c.qkv_dim()), p + "bqkv", &d.bqkv));
    }
    if (c.has_o_bias()) {
      SPECSERVE_RETURN_IF_ERROR(add_f32(w.bo, hidden, p + "bo", &d.bo));
    }
    if (c.has_qk_norm()) {
      SPECSERVE_RETURN_IF_ERROR(
          add_f32(w.q_norm, head_dim, p + "q_norm", &d.q_norm));
      SPECSERVE_RETURN_IF_ERROR(
          add_f32(w.k_norm, head_dim, p + "k_norm", &d.k_norm));
    }
  }
  return std::shared_ptr<const CudaWeights>(std::move(out));
}

}  // namespace specserve
