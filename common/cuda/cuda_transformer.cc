#include "common/cuda/cuda_transformer.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/kernels.h"
#include "common/cuda/linear.h"

namespace specserve {
namespace {

// Sub-buffers of the workspace start on 256-byte boundaries (cudaMalloc's
// alignment): the attention kernels use 16-byte vector loads and WMMA needs
// 32-byte aligned tiles.
constexpr size_t kAlign = 256;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Carves aligned regions out of one allocation: first a dry run to size it,
// then the same calls against the real base pointer.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* Take(size_t bytes) {
    void* p = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ = AlignUp(offset_ + bytes);
    return p;
  }
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------
// CudaQueryCapture
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<CudaQueryCapture>> CudaQueryCapture::Create(
    const ModelConfig& config, int max_rows) {
  if (max_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaQueryCapture: max_rows must be >= 1, got ",
                     max_rows));
  }
  std::unique_ptr<CudaQueryCapture> cap(new CudaQueryCapture());
  cap->max_rows_ = max_rows;
  cap->num_layers_ = config.num_hidden_layers;
  cap->num_heads_ = config.num_attention_heads;
  cap->head_dim_ = config.head_dim;
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(
      sizeof(float) * static_cast<size_t>(cap->num_layers_) * max_rows *
      cap->num_heads_ * cap->head_dim_);
  if (!buf.ok()) return buf.status();
  cap->storage_ = *std::move(buf);
  return cap;
}

float* CudaQueryCapture::mutable_layer_queries(int layer) const {
  return storage_.as<float>() + static_cast<size_t>(layer) * max_rows_ *
                                    num_heads_ * head_dim_;
}

const float* CudaQueryCapture::layer_queries(int layer) const {
  return mutable_layer_queries(layer);
}

absl::StatusOr<std::vector<float>> CudaQueryCapture::CopyToHost() const {
  const size_t row = static_cast<size_t>(num_heads_) * head_dim_;
  std::vector<float> host(static_cast<size_t>(num_layers_) * rows_ * row);
  if (host.empty()) return host;
  // Rows are contiguous at the start of each layer's plane.
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(
      host.data(), rows_ * row * sizeof(float), storage_.get(),
      max_rows_ * row * sizeof(float), rows_ * row * sizeof(float),
      num_layers_, cudaMemcpyDeviceToHost));
  return host;
}

// ---------------------------------------------------------------------------
// CudaTransformer
// ---------------------------------------------------------------------------

CudaTransformer::CudaTransformer(std::shared_ptr<const CudaWeights> weights,
                                 cudaStream_t stream, cublasHandle_t cublas,
                                 int num_sms)
    : weights_(std::move(weights)),
      stream_(stream),
      cublas_(cublas),
      num_sms_(num_sms) {}

CudaTransformer::~CudaTransformer() {
  cublasDestroy(cublas_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<CudaTransformer>> CudaTransformer::Create(
    std::shared_ptr<const CudaWeights> weights) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CudaTransformer: weights is null");
  }
  int device = 0, num_sms = 0;
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &num_sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream = nullptr;
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas = nullptr;
  const cublasStatus_t st = cublasCreate(&cublas);
  if (st != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(stream);
    return CublasStatus(st, "cublasCreate");
  }
  const cublasStatus_t st2 = cublasSetStream(cublas, stream);
  if (st2 != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
    return CublasStatus(st2, "cublasSetStream");
  }
  return std::unique_ptr<CudaTransformer>(
      new CudaTransformer(std::move(weights), stream, cublas, num_sms));
}

void CudaTransformer::set_attention_path(AttentionPath path) {
  absl::MutexLock lock(&mu_);
  attention_path_ = path;
}

absl::Status CudaTransformer::Forward(const ForwardInput& in,
                                      CudaKvCache* cache, ForwardOutput* out,
                                      CudaQueryCapture* capture) const {
  const ModelConfig& c = config();
  const int n = static_cast<int>(in.token_ids.size());
  // The CPU backend's validation: same rules, same messages.
  absl::StatusOr<std::vector<int>> rows_or = ValidateForwardInput(c, in);
  if (!rows_or.ok()) return rows_or.status();
  std::vector<int> logit_rows = *std::move(rows_or);
  if (cache == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("Forward: cache and out are required");
  }
  if (cache->dtype() != weights_->dtype() ||
      cache->num_layers() != c.num_hidden_layers ||
      cache->row_width() != c.num_key_value_heads * c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache (", cache->num_layers(), " layers x ", cache->row_width(),
        " ", CudaDTypeName(cache->dtype()), ") does not fit the model (",
        c.num_hidden_layers, " layers x ",
        c.num_key_value_heads * c.head_dim, " ",
        CudaDTypeName(weights_->dtype()), ")"));
  }
  const int nq = static_cast<int>(in.capture_query_rows.size());
  if (capture != nullptr) {
    if (capture->num_layers() != c.num_hidden_layers ||
        capture->num_heads() != c.num_attention_heads ||
        capture->head_dim() != c.head_dim) {
      return absl::InvalidArgumentError(
          "query capture was created for another model shape");
    }
    if (capture->rows() + nq > capture->max_rows()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "query capture full: ", capture->rows(), " rows + ", nq,
          " new exceed max_rows ", capture->max_rows()));
    }
  }

  absl::MutexLock lock(&mu_);
  absl::StatusOr<int> first_or = cache->Reserve(n);
  if (!first_or.ok()) return first_or.status();
  const int first = *first_or;
  cache->SetPositions(first, in.position_ids.data(), n);
  const int capture_rows_before = capture != nullptr ? capture->rows() : 0;
  absl::Status status = Run(in, logit_rows, first, cache, out, capture);
  if (!status.ok()) {
    // Nothing is appended on failure. Drain the stream first so no kernel
    // still writes into what the caller may reuse.
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
    cache->Truncate(first).IgnoreError();
    if (capture != nullptr) capture->rows_ = capture_rows_before;
  }
  return status;
}

absl::Status CudaTransformer::Run(const ForwardInput& in,
                                  const std::vector<int>& logit_rows,
                                  int first, CudaKvCache* cache,
                                  ForwardOutput* out,
                                  CudaQueryCapture* capture) const {
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  const size_t tb = CudaDTypeBytes(dt);
  const int n = static_cast<int>(in.token_ids.size());
  const int r = static_cast<int>(logit_rows.size());
  const int nq = static_cast<int>(in.capture_query_rows.size());
  const int hidden = c.hidden_size, H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim;
  const int ffn = c.intermediate_size, qkv_dim = c.qkv_dim();
  const int L = c.num_hidden_layers, vocab = c.vocab_size;
  const size_t N = n, qrow = static_cast<size_t>(H) * D;

  cuda_kernels::AttentionArgs attn_args;
  attn_args.dtype = dt;
  attn_args.n = n;
  attn_args.first = first;
  attn_args.num_heads = H;
  attn_args.num_kv_heads = KV;
  attn_args.head_dim = D;
  attn_args.scale = 1.0f / std::sqrt(static_cast<float>(D));
  bool use_flash = cuda_kernels::FlashAttentionSupported(D, dt);
  if (attention_path_ == AttentionPath::kAuto) {
    use_flash = use_flash && n >= kFlashMinRows;
  } else if (attention_path_ == AttentionPath::kSplitK) {
    use_flash = false;
  }
  const int splits =
      use_flash ? 0 : cuda_kernels::SplitKAttentionSplits(attn_args, num_sms_);

  // Workspace layout (sized by a dry run with a null base).
  struct Regions {
    int* ints;  // [n] ids, [n] positions, [r] logit rows
    float* x;   // fp32 [n, hidden] residual stream
    void* xn;   // T [max(n, r), hidden] normed input of a projection
    float* qkv; // fp32 [n, qkv_dim]
    void* q;    // T [n, H * D]
    void* attn; // T [n, H * D]
    void* gu;   // T [n, 2 * ffn]
    void* act;  // T [n, ffn]
    float* logits;    // fp32 [r, vocab]
    float* captured;  // fp32 [L, nq, H * D] (host capture only)
    void* split_ws;   // split-K partials
  };
  auto carve = [&](char* base, Regions* reg) {
    Carver cv(base);
    reg->ints = static_cast<int*>(cv.Take(sizeof(int) * (2 * N + r)));
    reg->x = static_cast<float*>(cv.Take(sizeof(float) * N * hidden));
    // Also holds the final norm of the logit rows (which may repeat).
    reg->xn = cv.Take(tb * std::max<size_t>(N, r) * hidden);
    reg->qkv = static_cast<float*>(cv.Take(sizeof(float) * N * qkv_dim));
    reg->q = cv.Take(tb * N * qrow);
    reg->attn = cv.Take(tb * N * qrow);
    reg->gu = cv.Take(tb * N * 2 * ffn);
    reg->act = cv.Take(tb * N * ffn);
    reg->logits = static_cast<float*>(
        cv.Take(sizeof(float) * static_cast<size_t>(r) * vocab));
    reg->captured = static_cast<float*>(cv.Take(
        capture == nullptr ? sizeof(float) * L * static_cast<size_t>(nq) * qrow
                           : 0));
    reg->split_ws = cv.Take(
        use_flash ? 0
                  : cuda_kernels::SplitKAttentionWorkspaceBytes(attn_args,
                                                                splits));
    return cv.size();
  };
  Regions reg;
  SPECSERVE_RETURN_IF_ERROR(workspace_.Reserve(carve(nullptr, &reg)));
  carve(workspace_.as<char>(), &reg);
  int* d_ids = reg.ints;
  int* d_pos = reg.ints + n;
  int* d_rows = reg.ints + 2 * n;

  std::vector<int> host_ints(2 * N + r);
  std::memcpy(host_ints.data(), in.token_ids.data(), sizeof(int) * N);
  std::memcpy(host_ints.data() + n, in.position_ids.data(), sizeof(int) * N);
  std::memcpy(host_ints.data() + 2 * n, logit_rows.data(), sizeof(int) * r);
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(reg.ints, host_ints.data(), sizeof(int) * host_ints.size(),
                      cudaMemcpyHostToDevice, stream_));

  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::EmbeddingGather(
      weights_->embed(), dt, d_ids, n, hidden, reg.x, stream_));
  const int capture_row0 = capture != nullptr ? capture->rows() : 0;
  for (int l = 0; l < L; ++l) {
    const CudaLayerWeights& w = weights_->layer(l);
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
        reg.x, nullptr, n, hidden, w.attn_norm, c.rms_norm_eps, reg.xn, dt,
        stream_));
    SPECSERVE_RETURN_IF_ERROR(CublasLinear(cublas_, dt, reg.xn, n, hidden,
                                           w.wqkv, qkv_dim, reg.qkv,
                                           CudaDType::kF32, 0.0f));
    cuda_kernels::RopeArgs rope;
    rope.qkv = reg.qkv;
    rope.n = n;
    rope.num_heads = H;
    rope.num_kv_heads = KV;
    rope.head_dim = D;
    rope.positions = d_pos;
    rope.theta = c.rope_theta;
    rope.q_out = reg.q;
    rope.k_cache = cache->keys(l);
    rope.v_cache = cache->values(l);
    rope.cache_first = first;
    rope.dtype = dt;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RopeQkvStore(rope, stream_));
    // Post-RoPE fp32 queries of the capture rows (q heads lead each row).
    for (int j = 0; j < nq; ++j) {
      float* dst =
          capture != nullptr
              ? capture->mutable_layer_queries(l) + (capture_row0 + j) * qrow
              : reg.captured + (static_cast<size_t>(l) * nq + j) * qrow;
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          dst, reg.qkv + static_cast<size_t>(in.capture_query_rows[j]) * qkv_dim,
          sizeof(float) * qrow, cudaMemcpyDeviceToDevice, stream_));
    }
    attn_args.q = reg.q;
    attn_args.k_cache = cache->keys(l);
    attn_args.v_cache = cache->values(l);
    attn_args.out = reg.attn;
    if (use_flash) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(
          cuda_kernels::FlashAttention(attn_args, stream_));
    } else {
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::SplitKAttention(
          attn_args, splits, reg.split_ws, stream_));
    }
    // o_proj with beta = 1: the residual add, into the fp32 stream.
    SPECSERVE_RETURN_IF_ERROR(CublasLinear(cublas_, dt, reg.attn, n, H * D,
                                           w.wo, hidden, reg.x,
                                           CudaDType::kF32, 1.0f));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
        reg.x, nullptr, n, hidden, w.mlp_norm, c.rms_norm_eps, reg.xn, dt,
        stream_));
    SPECSERVE_RETURN_IF_ERROR(CublasLinear(cublas_, dt, reg.xn, n, hidden,
                                           w.w_gate_up, 2 * ffn, reg.gu, dt,
                                           0.0f));
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cuda_kernels::SiluMul(reg.gu, n, ffn, reg.act, dt, stream_));
    SPECSERVE_RETURN_IF_ERROR(CublasLinear(cublas_, dt, reg.act, n, ffn,
                                           w.w_down, hidden, reg.x,
                                           CudaDType::kF32, 1.0f));
  }

  // Final norm and vocabulary projection for the requested rows only.
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
      reg.x, d_rows, r, hidden, weights_->final_norm(), c.rms_norm_eps,
      reg.xn, dt, stream_));
  SPECSERVE_RETURN_IF_ERROR(CublasLinear(cublas_, dt, reg.xn, r, hidden,
                                         weights_->lm_head(), vocab,
                                         reg.logits, CudaDType::kF32, 0.0f));
  out->logits.resize(static_cast<size_t>(r) * vocab);
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      out->logits.data(), reg.logits, sizeof(float) * out->logits.size(),
      cudaMemcpyDeviceToHost, stream_));
  if (capture == nullptr) {
    out->queries.resize(static_cast<size_t>(L) * nq * qrow);
    if (!out->queries.empty()) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          out->queries.data(), reg.captured,
          sizeof(float) * out->queries.size(), cudaMemcpyDeviceToHost,
          stream_));
    }
  } else {
    out->queries.clear();
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (capture != nullptr) capture->rows_ = capture_row0 + nq;
  out->logit_rows = logit_rows;
  return absl::OkStatus();
}

}  // namespace specserve
