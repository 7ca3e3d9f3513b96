#include "common/cuda/cuda_model_runner.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cuda/attention_plan.h"
#include "common/cuda/cuda_importance.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/flash_mma.h"
#include "common/cuda/kernels.h"
#include "common/cuda/linear.h"
#include "common/cuda/sampling_kernels.h"
#include "common/cuda/step_inputs.h"

namespace specserve {
namespace {

// Token i of the warm-up and tuning prompts: ids spread over the
// vocabulary; any would do.
int SpreadToken(int i, int vocab) {
  return static_cast<int>((int64_t{i} * 7919 + 13) % vocab);
}

// The phases of a forward PhaseTimer times (EnqueueForward), in a layer's
// order.
enum ForwardPhase {
  kPhaseEmbed,
  kPhaseNorm,
  kPhaseQkvProj,
  kPhaseRopeKvStore,
  kPhaseKvGather,
  kPhaseAttention,
  kPhaseRowGather,
  kPhaseOProj,
  kPhaseGateUpProj,
  kPhaseSiluMul,
  kPhaseDownProj,
  kPhaseLogits,
};

std::vector<std::string> ForwardPhaseNames() {
  return {"embed",      "norm",      "qkv_proj",     "rope_kv_store",
          "kv_gather",  "attention", "row_gather",   "o_proj",
          "gate_up_proj", "silu_mul", "down_proj",   "logits"};
}

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
// CudaModelRunner
// ---------------------------------------------------------------------------

size_t CudaModelRunner::BytesPerToken(const ModelConfig& c, CudaDType dtype) {
  return 2 * CudaDTypeBytes(dtype) * static_cast<size_t>(c.num_hidden_layers) *
         c.num_key_value_heads * c.head_dim;
}

CudaModelRunner::CudaModelRunner(std::shared_ptr<const CudaWeights> weights,
                                 cudaStream_t stream, cublasHandle_t cublas,
                                 int num_sms)
    : weights_(std::move(weights)),
      stream_(stream),
      cublas_(cublas),
      num_sms_(num_sms),
      row_width_(weights_->config().num_key_value_heads *
                 weights_->config().head_dim),
      phase_timer_(ForwardPhaseNames()) {}

CudaModelRunner::~CudaModelRunner() {
  // cuDNN's plans own kernels that may still be queued, and its handle is
  // bound to stream_: both go before the stream.
  absl::MutexLock lock(&mu_);
  cudaStreamSynchronize(stream_);
  cudnn_.reset();
  DropGraphs();
  cublasDestroy(cublas_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    std::shared_ptr<const CudaWeights> weights, const KvCacheOptions& o) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CudaModelRunner: weights is null");
  }
  const ModelConfig& c = weights->config();
  const size_t per_token = BytesPerToken(c, weights->dtype());
  SPECSERVE_RETURN_IF_ERROR(ValidateKvCacheOptions(o, per_token));
  const int num_blocks = KvPoolBlocks(o, per_token, c.max_position_embeddings);
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
  std::unique_ptr<CudaModelRunner> r(
      new CudaModelRunner(std::move(weights), stream, cublas, num_sms));
  // cuBLAS's own workspace, set explicitly so that a GEMM captured into a
  // CUDA graph never allocates (32 MiB: NVIDIA's advice for Hopper).
  absl::StatusOr<DeviceBuffer> cublas_ws = DeviceBuffer::Allocate(32 << 20);
  if (!cublas_ws.ok()) return cublas_ws.status();
  r->cublas_workspace_ = *std::move(cublas_ws);
  SPECSERVE_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(
      cublas, r->cublas_workspace_.get(), r->cublas_workspace_.bytes()));
  absl::StatusOr<DeviceBuffer> pool =
      DeviceBuffer::Allocate(per_token * o.block_size * size_t(num_blocks));
  if (!pool.ok()) return pool.status();
  r->pool_ = *std::move(pool);
  CudaModelRunner* self = r.get();
  r->cache_ = std::make_unique<PagedKvCache>(
      num_blocks, o.block_size, per_token,
      [self](int src, int dst) { return self->CopyBlock(src, dst); });
  r->cache_->EnablePrefixCaching(o.prefix_caching);
  return r;
}

void* CudaModelRunner::keys(int layer) const {
  const size_t plane = static_cast<size_t>(cache_->num_blocks()) *
                       cache_->block_size() * row_width_ *
                       CudaDTypeBytes(weights_->dtype());
  return pool_.as<char>() + 2 * static_cast<size_t>(layer) * plane;
}

void* CudaModelRunner::values(int layer) const {
  const size_t plane = static_cast<size_t>(cache_->num_blocks()) *
                       cache_->block_size() * row_width_ *
                       CudaDTypeBytes(weights_->dtype());
  return pool_.as<char>() + (2 * static_cast<size_t>(layer) + 1) * plane;
}

absl::Status CudaModelRunner::CopyBlock(int src, int dst) {
  const size_t block = static_cast<size_t>(cache_->block_size()) *
                       row_width_ * CudaDTypeBytes(weights_->dtype());
  for (int l = 0; l < config().num_hidden_layers; ++l) {
    for (void* plane : {keys(l), values(l)}) {
      char* p = static_cast<char*>(plane);
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          p + dst * block, p + src * block, block, cudaMemcpyDeviceToDevice,
          stream_));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CudaModelRunner::CopyKeysToHost(
    int layer, const KvSequence& kv, int count) const {
  if (layer < 0 || layer >= config().num_hidden_layers || count < 1 ||
      count > kv.size()) {
    return absl::InvalidArgumentError("CopyKeysToHost: bad layer or count");
  }
  // Copy-on-write copies (KvSequence::Reserve outside Forward) are queued
  // on stream_; the reads below run on the default stream.
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const CudaDType dt = weights_->dtype();
  const size_t n = static_cast<size_t>(count) * row_width_;
  absl::StatusOr<DeviceBuffer> tmp =
      DeviceBuffer::Allocate(n * (CudaDTypeBytes(dt) + sizeof(float)) +
                             sizeof(int) * kv.block_table().size());
  if (!tmp.ok()) return tmp.status();
  int* d_table = tmp->as<int>();
  char* dense = tmp->as<char>() + sizeof(int) * kv.block_table().size();
  float* f32 = reinterpret_cast<float*>(dense + n * CudaDTypeBytes(dt));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      d_table, kv.block_table().data(), sizeof(int) * kv.block_table().size(),
      cudaMemcpyHostToDevice));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::GatherKvRows(
      keys(layer), dt, d_table, cache_->block_size(), count, row_width_,
      dense, nullptr));
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cuda_kernels::ConvertToF32(dense, dt, f32, n, nullptr));
  std::vector<float> host(n);
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      host.data(), f32, n * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

void CudaModelRunner::set_attention_path(AttentionPath path) {
  absl::MutexLock lock(&mu_);
  attention_path_ = path;
  if (path != AttentionPath::kCudnn) return;
  // cuDNN compiles its kernels while planning (once per mask alignment
  // with dynamic shapes): pay that here, not in a request's prefill.
  const ModelConfig& c = config();
  for (int s_kv : {kWarmCudnnRows, 2 * kWarmCudnnRows}) {
    const CudnnSdpaShape shape{kWarmCudnnRows, s_kv, c.num_attention_heads,
                               c.num_key_value_heads, c.head_dim,
                               weights_->dtype()};
    if (ValidateCudnnSdpaShape(shape).ok()) CudnnSupports(shape);
  }
}

void CudaModelRunner::set_cudnn_plan_every_chunk(bool enabled) {
  absl::MutexLock lock(&mu_);
  cudnn_plan_every_chunk_ = enabled;
}

int CudaModelRunner::cudnn_plans_built() {
  absl::MutexLock lock(&mu_);
  return cudnn_ == nullptr ? 0 : cudnn_->plans_built();
}

CudaModelRunner::AttentionPath CudaModelRunner::attention_path() {
  absl::MutexLock lock(&mu_);
  return attention_path_;
}

void CudaModelRunner::set_phase_timing(bool enabled) {
  absl::MutexLock lock(&mu_);
  phase_timing_ = enabled;
}

std::vector<std::pair<std::string, double>> CudaModelRunner::TakePhaseTimes(
    int* forwards) {
  absl::MutexLock lock(&mu_);
  return phase_timer_.Take(forwards);
}

absl::Status CudaModelRunner::RowLogprobsOnDevice(
    absl::Span<const SequenceForward> batch, const std::vector<int>& lr0,
    const std::vector<int>& argmax, const std::vector<int>& samp_out,
    int num_sampled, const float* d_logits,
    std::vector<TokenLogprobs>* row_logprobs) {
  const int vocab = config().vocab_size;
  std::vector<int> ints;  // rows, then tokens
  std::vector<int> tokens;
  int top_n = 0, samp_next = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const ForwardInput& in = batch[i].input;
    const int rows = lr0[i + 1] - lr0[i];
    if (in.logprobs_top_n >= 0) {
      top_n = std::max(top_n, std::min(in.logprobs_top_n, vocab));
      for (int r = 0; r < rows; ++r) {
        int token = -1;  // the row's token: argmax, accepted draft or sample
        if (in.argmax_only) {
          token = in.logprob_ids.empty() || in.logprob_ids[r] < 0
                      ? argmax[lr0[i] + r]
                      : in.logprob_ids[r];  // teacher-forced (prompt rows)
        } else if (in.sampling != nullptr) {
          const bool accepted = samp_out[num_sampled + samp_next + r] != 0;
          token = accepted ? in.sampling->draft_ids[r]
                           : samp_out[samp_next + r];
        }
        ints.push_back(lr0[i] + r);
        tokens.push_back(token);
      }
    }
    if (in.sampling != nullptr) samp_next += rows;
  }
  const int jobs = static_cast<int>(tokens.size());
  if (jobs == 0) return absl::OkStatus();  // most steps: nothing, no work
  row_logprobs->assign(lr0.back(), TokenLogprobs());
  ints.insert(ints.end(), tokens.begin(), tokens.end());
  const size_t top = static_cast<size_t>(jobs) * top_n;
  const size_t int_bytes = sizeof(int) * (ints.size() + top);
  SPECSERVE_RETURN_IF_ERROR(logprobs_ws_.Reserve(
      int_bytes + sizeof(float) * (jobs + top)));
  int* d_ints = logprobs_ws_.as<int>();
  int* d_top_ids = d_ints + ints.size();
  float* d_lp = reinterpret_cast<float*>(logprobs_ws_.as<char>() + int_bytes);
  float* d_top_lp = d_lp + jobs;
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_ints, ints.data(), sizeof(int) * ints.size(),
                      cudaMemcpyHostToDevice, stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RowLogprobs(
      d_logits, vocab, d_ints, d_ints + jobs, jobs, top_n, d_lp, d_top_ids,
      d_top_lp, stream_));
  std::vector<float> lp(jobs + top);
  std::vector<int> ids(top);
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      lp.data(), d_lp, sizeof(float) * lp.size(), cudaMemcpyDeviceToHost,
      stream_));
  if (top > 0) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(ids.data(), d_top_ids, sizeof(int) * top,
                        cudaMemcpyDeviceToHost, stream_));
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  for (int j = 0; j < jobs; ++j) {
    TokenLogprobs& t = (*row_logprobs)[ints[j]];
    t.logprob = lp[j];
    for (int k = 0; k < top_n; ++k) {
      const size_t at = static_cast<size_t>(j) * top_n + k;
      t.top.emplace_back(ids[at], lp[jobs + at]);
    }
  }
  return absl::OkStatus();
}

bool CudaModelRunner::CudnnSupports(const CudnnSdpaShape& shape) {
  if (cudnn_ == nullptr) {
    if (cudnn_unavailable_) return false;
    absl::StatusOr<std::unique_ptr<CudnnAttention>> created =
        CudnnAttention::Create(stream_);
    if (!created.ok()) {
      cudnn_unavailable_ = true;
      std::fprintf(stderr,
                   "prefill attention: cuDNN unavailable, FlashAttention "
                   "instead: %s\n",
                   created.status().ToString().c_str());
      return false;
    }
    cudnn_ = *std::move(created);
    std::fprintf(stderr, "prefill attention: cuDNN %zu\n",
                 CudnnAttention::LibraryVersion());
  }
  const int built = cudnn_->plans_built();
  const absl::Status prepared = cudnn_->Prepare(shape);
  if (!prepared.ok() && cudnn_->plans_built() > built) {  // once per shape
    std::fprintf(stderr,
                 "prefill attention: FlashAttention for s_q=%d s_kv=%d: %s\n",
                 shape.s_q, shape.s_kv, prepared.ToString().c_str());
  } else if (prepared.ok() && built == 0) {  // the first plan
    std::fprintf(stderr,
                 "prefill attention: first cuDNN plan (s_q=%d s_kv=%d, %s) "
                 "in %.3f s\n",
                 shape.s_q, shape.s_kv, cudnn_->last_plan_form().c_str(),
                 cudnn_->plan_build_seconds());
  } else if (prepared.ok() && cudnn_->plans_built() > built) {
    // A new chunk shape planned inside a request's prefill: its cost is in
    // that request's TTFT. The first 64, then every 64th (running totals).
    const int n = cudnn_->plans_built();
    if (n <= 64 || n % 64 == 0) {
      std::fprintf(stderr,
                   "cudnn plan %d: s_q=%d s_kv=%d, %s; %.3f s for all so far\n",
                   n, shape.s_q, shape.s_kv, cudnn_->last_plan_form().c_str(),
                   cudnn_->plan_build_seconds());
    }
  }
  return prepared.ok();
}

void CudaModelRunner::DropGraphs() {
  cudaStreamSynchronize(stream_);  // a replay may still run
  for (auto* execs : {&graphs_, &sampled_graphs_, &capture_graphs_}) {
    for (cudaGraphExec_t& exec : *execs) {
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      exec = nullptr;
    }
  }
}

void CudaModelRunner::set_skinny_linear(bool everywhere) {
  absl::MutexLock lock(&mu_);
  linear_ = LinearDispatch();
  if (everywhere) linear_.UseSkinnyEverywhere();
  DropGraphs();
}

absl::StatusOr<std::vector<SkinnyLinearTrial>>
CudaModelRunner::TuneSkinnyLinear(int max_rows) {
  absl::MutexLock lock(&mu_);
  LinearDispatch tuned;
  absl::StatusOr<std::vector<SkinnyLinearTrial>> trials =
      specserve::TuneSkinnyLinear(*weights_, cublas_, stream_, max_rows,
                                  &tuned);
  if (!trials.ok()) return trials.status();
  linear_ = tuned;
  DropGraphs();
  return trials;
}

absl::StatusOr<std::string> CudaModelRunner::ChooseDecodeGemm(
    absl::string_view mode) {
  SPECSERVE_RETURN_IF_ERROR(ValidateDecodeGemm(mode));
  if (mode == "auto") {
    absl::StatusOr<std::vector<SkinnyLinearTrial>> trials =
        TuneSkinnyLinear();
    if (!trials.ok()) return trials.status();
    return DescribeSkinnyTuning(*trials);
  }
  set_skinny_linear(mode == "skinny");
  return mode == "skinny"
             ? "decode GEMMs: skinny wherever it takes the shape "
               "(--decode_gemm=skinny)"
             : "decode GEMMs: cuBLAS (--decode_gemm=cublas)";
}

int64_t CudaModelRunner::skinny_linear_launches() {
  absl::MutexLock lock(&mu_);
  return linear_.skinny_launches();
}

void CudaModelRunner::set_cuda_graphs(bool enabled) {
  absl::MutexLock lock(&mu_);
  cuda_graphs_ = enabled;
}

bool CudaModelRunner::cuda_graphs() {
  absl::MutexLock lock(&mu_);
  return cuda_graphs_;
}

int64_t CudaModelRunner::graph_replays() {
  absl::MutexLock lock(&mu_);
  return graph_replays_;
}

int CudaModelRunner::graphs_captured() {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (cudaGraphExec_t g : graphs_) n += g != nullptr;
  for (cudaGraphExec_t g : sampled_graphs_) n += g != nullptr;
  for (cudaGraphExec_t g : capture_graphs_) n += g != nullptr;
  return n;
}

absl::Status CudaModelRunner::WarmUp(int prefill_rows, int max_batch) {
  const ModelConfig& c = config();
  const int block = cache_->block_size();
  auto token = [&c](int i) { return SpreadToken(i, c.vocab_size); };
  const int n = std::min({prefill_rows, c.max_position_embeddings,
                          cache_->num_blocks() / 2 * block});
  if (n > 0) {
    absl::StatusOr<std::unique_ptr<KvSequence>> seq = NewSequence(n);
    if (!seq.ok()) return seq.status();
    std::vector<int> ids(n), pos(n);
    for (int i = 0; i < n; ++i) {
      ids[i] = token(i);
      pos[i] = i;
    }
    ForwardInput in;
    in.token_ids = ids;
    in.position_ids = pos;
    in.argmax_only = true;
    ForwardOutput out;
    SPECSERVE_RETURN_IF_ERROR(Forward(in, seq->get(), &out));
  }
  const int top = std::min(max_batch, kMaxGraphRows);
  for (int rows = 1; rows <= top && cuda_graphs(); ++rows) {
    const int b = cuda_step::GraphBucket(rows);
    // Each bucket once, and only while the pool has a block per row.
    if (b != rows || b > top || b > cache_->num_free_blocks()) continue;
    std::vector<std::unique_ptr<KvSequence>> seqs;
    std::vector<int> ids(b);
    for (int i = 0; i < b; ++i) {
      absl::StatusOr<std::unique_ptr<KvSequence>> s = NewSequence(2);
      if (!s.ok()) return s.status();
      seqs.push_back(*std::move(s));
      ids[i] = token(i);
    }
    const int positions[2] = {0, 1};
    // One greedy step, then one sampled step (a graph each).
    RowSampling sampling;
    sampling.params.temperature = 1.0f;
    sampling.draft_ids = {-1};
    sampling.draft_q = {nullptr};
    sampling.uniforms = {0.5, 0.5};
    for (int step = 0; step < 2; ++step) {
      std::vector<SequenceForward> batch(b);
      for (int i = 0; i < b; ++i) {
        batch[i].kv = seqs[i].get();
        batch[i].input.token_ids = absl::MakeConstSpan(&ids[i], 1);
        batch[i].input.position_ids = absl::MakeConstSpan(&positions[step], 1);
        if (step == 0) {
          batch[i].input.argmax_only = true;
        } else {
          batch[i].input.sampling = &sampling;
        }
      }
      std::vector<ForwardOutput> out;
      SPECSERVE_RETURN_IF_ERROR(Forward(batch, &out));
    }
  }
  // A one-row greedy step that captures its query: a scoring request's
  // look-ahead step (Speculative Prefill), graphed from its first one.
  if (top >= 1 && cuda_graphs() && cache_->num_free_blocks() >= 1) {
    absl::StatusOr<std::unique_ptr<KvSequence>> seq = NewSequence(1);
    if (!seq.ok()) return seq.status();
    absl::StatusOr<std::unique_ptr<QueryCapture>> capture = NewQueryCapture(1);
    if (!capture.ok()) return capture.status();
    const int id = token(0), position = 0;
    std::vector<SequenceForward> batch(1);
    batch[0].kv = seq->get();
    batch[0].capture = capture->get();
    batch[0].input.token_ids = absl::MakeConstSpan(&id, 1);
    batch[0].input.position_ids = absl::MakeConstSpan(&position, 1);
    batch[0].input.argmax_only = true;
    batch[0].input.capture_query_rows = {0};
    std::vector<ForwardOutput> out;
    SPECSERVE_RETURN_IF_ERROR(Forward(batch, &out));
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefillTuning> CudaModelRunner::TunePrefillAttention(
    int context_tokens, int chunk_rows, int reps) {
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  const int block = cache_->block_size();
  const int n = std::min({context_tokens, c.max_position_embeddings,
                          cache_->num_free_blocks() / 2 * block});
  const int chunk = std::min(chunk_rows, n / 2);
  if (chunk < kFlashMinRows) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefill tuning needs a chunk of at least ", kFlashMinRows,
        " rows; the model's context and the pool allow ", std::max(chunk, 0)));
  }
  const int first = n - chunk;  // the timed chunk is [first, n)

  // The candidates, the reference first; `applies` false with the reason
  // in the trial's note.
  struct Candidate {
    AttentionPath path;
    bool applies;
    PrefillPathTrial trial;
  };
  std::vector<Candidate> cands(3);
  cands[0].path = AttentionPath::kAuto;
  cands[0].applies = true;
  cands[0].trial.name =
      cuda_kernels::FlashAttentionSupported(c.head_dim, dt) ? "flash"
                                                            : "batched";
  cands[1].path = AttentionPath::kFlashMma;
  cands[1].trial.name = "mma";
  cands[1].applies = cuda_kernels::FlashMmaSupported(c.head_dim, dt);
  if (!cands[1].applies) {
    cands[1].trial.note = absl::StrCat("head_dim ", c.head_dim, " in ",
                                       CudaDTypeName(dt), " not supported");
  }
  cands[2].path = AttentionPath::kCudnn;
  cands[2].trial.name = "cudnn";
  const AttentionPath before = attention_path();
  {
    absl::MutexLock lock(&mu_);
    const CudnnSdpaShape shape{chunk, n, c.num_attention_heads,
                               c.num_key_value_heads, c.head_dim, dt};
    const absl::Status valid = ValidateCudnnSdpaShape(shape);
    cands[2].applies = valid.ok() && CudnnSupports(shape);
    if (!valid.ok()) {
      cands[2].trial.note = std::string(valid.message());
    } else if (!cands[2].applies) {
      cands[2].trial.note = cudnn_unavailable_ ? kLibcudnnUnavailable
                                               : "no cuDNN engine for the shape";
    }
  }

  absl::StatusOr<std::unique_ptr<KvSequence>> seq = NewSequence(n);
  if (!seq.ok()) return seq.status();
  std::vector<int> ids(n), pos(n);
  for (int i = 0; i < n; ++i) {
    ids[i] = SpreadToken(i, c.vocab_size);
    pos[i] = i;
  }
  auto fail = [&](const absl::Status& s) {
    set_attention_path(before);
    return s;
  };
  // The cached context before the chunk, with the reference kernel.
  set_attention_path(AttentionPath::kAuto);
  for (int a = 0; a < first; a += chunk) {
    const int len = std::min(chunk, first - a);
    ForwardInput in;
    in.token_ids = absl::MakeConstSpan(ids).subspan(a, len);
    in.position_ids = absl::MakeConstSpan(pos).subspan(a, len);
    in.argmax_only = true;
    ForwardOutput out;
    if (absl::Status s = Forward(in, seq->get(), &out); !s.ok()) {
      return fail(s);
    }
  }
  ForwardInput last;
  last.token_ids = absl::MakeConstSpan(ids).subspan(first, chunk);
  last.position_ids = absl::MakeConstSpan(pos).subspan(first, chunk);
  // One forward of the chunk: wall seconds (Forward returns once the
  // logits are on the host), its last row's logits into *logits if set.
  auto run_chunk = [&](std::vector<float>* logits) -> absl::StatusOr<double> {
    SPECSERVE_RETURN_IF_ERROR((*seq)->Truncate(first));
    ForwardOutput out;
    const absl::Time start = absl::Now();
    SPECSERVE_RETURN_IF_ERROR(Forward(last, seq->get(), &out));
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    if (logits != nullptr) *logits = std::move(out.logits);
    return s;
  };

  PrefillTuning tuning;
  tuning.context_tokens = n;
  tuning.chunk_rows = chunk;
  std::vector<float> ref_logits;
  for (size_t i = 0; i < cands.size(); ++i) {
    PrefillPathTrial& t = cands[i].trial;
    if (!cands[i].applies) continue;
    set_attention_path(cands[i].path);
    std::vector<float> logits;
    absl::StatusOr<double> untimed = run_chunk(&logits);
    std::vector<double> times;
    for (int r = 0; untimed.ok() && r < std::max(reps, 1); ++r) {
      absl::StatusOr<double> timed = run_chunk(nullptr);
      if (!timed.ok()) {
        untimed = timed.status();
        break;
      }
      times.push_back(*timed);
    }
    if (!untimed.ok()) {
      if (i == 0) return fail(untimed.status());
      t.note = untimed.status().ToString();
      continue;
    }
    t.ran = true;
    t.seconds = MedianSeconds(times);
    if (i == 0) {
      ref_logits = std::move(logits);
      t.agrees = true;
    } else {
      t.max_rel_diff = MaxRelDiff(ref_logits, logits);
      t.agrees = TopOneAgrees(ref_logits, logits);
    }
  }
  for (const Candidate& cand : cands) tuning.trials.push_back(cand.trial);
  tuning.chosen = ChoosePrefillTrial(tuning.trials);
  set_attention_path(cands[tuning.chosen].path);
  return tuning;
}

absl::StatusOr<std::unique_ptr<QueryCapture>> CudaModelRunner::NewQueryCapture(
    int max_rows) {
  absl::StatusOr<std::unique_ptr<CudaQueryCapture>> c =
      CudaQueryCapture::Create(config(), max_rows);
  if (!c.ok()) return c.status();
  return std::unique_ptr<QueryCapture>(*std::move(c));
}

absl::Status CudaModelRunner::Forward(absl::Span<const SequenceForward> batch,
                                      std::vector<ForwardOutput>* out) {
  const ModelConfig& c = config();
  // The CPU backend's validation: same rules, same messages.
  absl::StatusOr<std::vector<std::vector<int>>> rows_or =
      ValidateBatch(c, *cache_, batch);
  if (!rows_or.ok()) return rows_or.status();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].capture == nullptr) continue;
    auto* cap = dynamic_cast<CudaQueryCapture*>(batch[i].capture);
    if (cap == nullptr || cap->num_layers() != c.num_hidden_layers ||
        cap->num_heads() != c.num_attention_heads ||
        cap->head_dim() != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch[", i,
          "]: the query capture belongs to another backend or model shape"));
    }
    const int nq = static_cast<int>(batch[i].input.capture_query_rows.size());
    if (cap->rows() + nq > cap->max_rows()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "query capture full: ", cap->rows(), " rows + ", nq,
          " new exceed max_rows ", cap->max_rows()));
    }
  }
  absl::MutexLock lock(&mu_);
  std::vector<int> first;
  SPECSERVE_RETURN_IF_ERROR(ReserveBatch(batch, &first));
  absl::Status status = Run(batch, *rows_or, first, out);
  if (!status.ok()) {
    // Nothing is appended on failure. Drain the stream first so no kernel
    // still writes into what the caller may reuse.
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
    UnreserveBatch(batch, first);
  }
  return status;
}

// Named (not anonymous): CudaModelRunner's nested StepLaunch and
// GraphLayout hold them.
namespace cuda_step {

// Device regions of one forward step, carved from one allocation.
struct StepRegions {
  int* ints;  // [N] ids, [N] positions, [N] slots, [R] logit rows, tables,
              // the batched attention plan (a graph: fixed capacities)
  float* x;   // fp32 [N, hidden] residual stream
  // The last layer's live rows when it prunes (StepLaunch::LastLayer):
  // fp32 [NL, hidden] residual, T [NL, H * D] attention output.
  float* x_live;
  void* attn_live;
  void* splitk_ws;  // the pruned suffixes' split-K partials
  void* xn;   // T [max(N, R), hidden] normed input of a projection
  float* qkv; // fp32 [N, qkv_dim]
  void* q;    // T [N, H * D]
  void* attn; // T [N, H * D]
  void* gu;   // T [N, 2 * ffn]
  void* act;  // T [N, ffn]
  float* logits;    // fp32 [R, vocab]
  int* argmax;      // [R] (argmax_only sequences' rows)
  float* captured;  // fp32 [L, NQ, H * D] (host capture only)
  // Where each captured row goes (CaptureQueryRows); a graph step's are
  // padded with unused slots.
  cuda_kernels::CaptureSlot* capture_slots;
  void* split_ws;   // batched attention's split partials
  int* tree_start;  // [N] tree attention span starts (trees only)
  unsigned long long* tree_mask;  // [N] visibility bits (trees only)
  // Row sampling (ForwardInput::sampling) of NS rows with NQ_IDS draft
  // distribution entries in all: ints [NS] logit rows, [NS] top-k, [NS]
  // draft ids, [NS + 1] q offsets, [NQ_IDS] q ids; floats [NS]
  // temperatures, [NS] top-p, [NS] min_p, [NQ_IDS] q probabilities; [NS, 2]
  // uniforms; out [NS] tokens, [NS] accept flags; the kernel's scratch.
  int* samp_ints;
  float* samp_floats;
  double* samp_uniforms;
  int* samp_out;
  void* samp_scratch;
  // Logit edits (ForwardInput::logit_edits; PackLogitEdits' layout): [R + 1]
  // offsets over the logit rows, then the edits.
  int* edit_offsets;
  LogitEdit* edits;
  // Token masks (LogitEdits' masks, eager steps only): [R] mask per logit
  // row (-1 none), then the masks' words.
  int* mask_of_row;
  uint32_t* allowed;
};

// Element counts of a step's regions.
struct StepSizes {
  size_t rows = 0;           // N
  size_t logit_rows = 0;     // R
  size_t captured_rows = 0;  // NQ
  size_t capture_slots = 0;
  size_t ints = 0;
  size_t split_ws_bytes = 0;
  size_t live_rows = 0;       // NL (0: the last layer computes every row)
  size_t splitk_ws_bytes = 0;
  size_t tree_rows = 0;
  size_t samp_rows = 0, samp_ints = 0, samp_floats = 0;
  size_t edit_rows = 0, edits = 0;  // edit_rows 0: no edit regions
  size_t mask_rows = 0, mask_words = 0;  // all masks' words in all
};

// Lays the regions out from `base` (null: a dry run that only sizes them)
// and returns the bytes they take.
size_t CarveStep(char* base, const ModelConfig& c, size_t tb,
                 const StepSizes& z, StepRegions* reg) {
  const size_t NN = z.rows, R = z.logit_rows, hidden = c.hidden_size;
  const size_t qrow = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  const size_t ffn = c.intermediate_size;
  DeviceCarver cv(base);
  reg->ints = static_cast<int*>(cv.Take(sizeof(int) * z.ints));
  reg->x = static_cast<float*>(cv.Take(sizeof(float) * NN * hidden));
  reg->x_live =
      static_cast<float*>(cv.Take(sizeof(float) * z.live_rows * hidden));
  reg->attn_live = cv.Take(tb * z.live_rows * qrow);
  reg->splitk_ws = cv.Take(z.splitk_ws_bytes);
  // Also holds the final norm of the logit rows (which may repeat).
  reg->xn = cv.Take(tb * std::max(NN, R) * hidden);
  reg->qkv = static_cast<float*>(cv.Take(sizeof(float) * NN * c.qkv_dim()));
  reg->q = cv.Take(tb * NN * qrow);
  reg->attn = cv.Take(tb * NN * qrow);
  reg->gu = cv.Take(tb * NN * 2 * ffn);
  reg->act = cv.Take(tb * NN * ffn);
  reg->logits =
      static_cast<float*>(cv.Take(sizeof(float) * R * c.vocab_size));
  reg->argmax = static_cast<int*>(cv.Take(sizeof(int) * R));
  reg->captured = static_cast<float*>(cv.Take(
      sizeof(float) * c.num_hidden_layers * z.captured_rows * qrow));
  reg->capture_slots = static_cast<cuda_kernels::CaptureSlot*>(
      cv.Take(sizeof(cuda_kernels::CaptureSlot) * z.capture_slots));
  reg->split_ws = cv.Take(z.split_ws_bytes);
  reg->tree_start = static_cast<int*>(cv.Take(sizeof(int) * z.tree_rows));
  reg->tree_mask = static_cast<unsigned long long*>(
      cv.Take(sizeof(uint64_t) * z.tree_rows));
  reg->samp_ints = static_cast<int*>(cv.Take(sizeof(int) * z.samp_ints));
  reg->samp_floats =
      static_cast<float*>(cv.Take(sizeof(float) * z.samp_floats));
  reg->samp_uniforms =
      static_cast<double*>(cv.Take(sizeof(double) * 2 * z.samp_rows));
  reg->samp_out = static_cast<int*>(cv.Take(sizeof(int) * 2 * z.samp_rows));
  reg->samp_scratch = cv.Take(cuda_kernels::SampleRowsScratchBytes(
      static_cast<int>(z.samp_rows), c.vocab_size));
  reg->edit_offsets = static_cast<int*>(
      cv.Take(sizeof(int) * (z.edit_rows > 0 ? z.edit_rows + 1 : 0)));
  reg->edits = static_cast<LogitEdit*>(cv.Take(sizeof(LogitEdit) * z.edits));
  reg->mask_of_row = static_cast<int*>(cv.Take(sizeof(int) * z.mask_rows));
  reg->allowed =
      static_cast<uint32_t*>(cv.Take(sizeof(uint32_t) * z.mask_words));
  return cv.size();
}

// The batched attention launch's fields every step shares (queries,
// outputs, shape, workspace); the caller adds the tables and the plan.
cuda_kernels::BatchedAttentionArgs BatchedArgs(const StepRegions& reg,
                                               const ModelConfig& c,
                                               CudaDType dtype,
                                               int block_size) {
  cuda_kernels::BatchedAttentionArgs ba;
  ba.q = reg.q;
  ba.out = reg.attn;
  ba.dtype = dtype;
  ba.num_heads = c.num_attention_heads;
  ba.num_kv_heads = c.num_key_value_heads;
  ba.head_dim = c.head_dim;
  ba.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  ba.block_size = block_size;
  ba.workspace = reg.split_ws;
  return ba;
}

// SampleRows over `num_rows` jobs in `reg`'s sampling regions, packed with
// `stride` (PackedRowSampling's layout).
cuda_kernels::SampleRowsArgs SampleArgs(const StepRegions& reg, int stride,
                                        int num_rows, int vocab) {
  using P = PackedRowSampling;
  cuda_kernels::SampleRowsArgs sa;
  sa.logits = reg.logits;
  sa.vocab = vocab;
  sa.num_rows = num_rows;
  sa.logit_row = reg.samp_ints;
  sa.top_k = reg.samp_ints + P::top_k_at(stride);
  sa.draft_id = reg.samp_ints + P::draft_id_at(stride);
  sa.q_offsets = reg.samp_ints + P::q_offsets_at(stride);
  sa.q_ids = reg.samp_ints + P::q_ids_at(stride);
  sa.temperature = reg.samp_floats;
  sa.top_p = reg.samp_floats + P::top_p_at(stride);
  sa.min_p = reg.samp_floats + P::min_p_at(stride);
  sa.q_probs = reg.samp_floats + P::q_probs_at(stride);
  sa.uniforms = reg.samp_uniforms;
  sa.scratch = reg.samp_scratch;
  sa.token = reg.samp_out;
  sa.accepted = reg.samp_out + stride;
  return sa;
}

// Copies packed jobs into `reg`'s sampling regions.
absl::Status UploadSampling(const PackedRowSampling& p, const StepRegions& reg,
                            cudaStream_t stream) {
  if (p.num_rows == 0) return absl::OkStatus();
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(reg.samp_ints, p.ints.data(), sizeof(int) * p.ints.size(),
                      cudaMemcpyHostToDevice, stream));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      reg.samp_floats, p.floats.data(), sizeof(float) * p.floats.size(),
      cudaMemcpyHostToDevice, stream));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      reg.samp_uniforms, p.uniforms.data(), sizeof(double) * p.uniforms.size(),
      cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

// Copies packed logit edits (offsets and edits) into `reg`'s edit regions.
absl::Status UploadEdits(const LogitEdits& e, const StepRegions& reg,
                         cudaStream_t stream) {
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      reg.edit_offsets, e.offsets.data(), sizeof(int) * e.offsets.size(),
      cudaMemcpyHostToDevice, stream));
  if (!e.edits.empty()) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.edits, e.edits.data(), sizeof(LogitEdit) * e.edits.size(),
        cudaMemcpyHostToDevice, stream));
  }
  if (e.has_masks()) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.mask_of_row, e.mask_of_row.data(),
        sizeof(int) * e.mask_of_row.size(), cudaMemcpyHostToDevice, stream));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.allowed, e.allowed.data(), sizeof(uint32_t) * e.allowed.size(),
        cudaMemcpyHostToDevice, stream));
  }
  return absl::OkStatus();
}

}  // namespace cuda_step

using cuda_step::BatchedArgs;
using cuda_step::CarveStep;
using cuda_step::SampleArgs;
using cuda_step::UploadEdits;
using cuda_step::UploadSampling;
using cuda_step::StepRegions;
using cuda_step::StepSizes;

// What EnqueueForward launches: the regions and the step's shape.
struct CudaModelRunner::StepLaunch {
  const StepRegions* reg = nullptr;
  int n = 0;  // rows
  int r = 0;  // logit rows
  const int* ids = nullptr;
  const int* positions = nullptr;
  const int* slots = nullptr;
  const int* logit_rows = nullptr;
  cuda_kernels::BatchedAttentionArgs ba;  // keys / values set per layer
  // FlashAttention and FlashMmaAttention sequences (eager only); keys /
  // values set per layer.
  std::vector<cuda_kernels::AttentionArgs>* flash = nullptr;
  std::vector<cuda_kernels::AttentionArgs>* flash_mma = nullptr;
  // cuDNN SDPA sequences (eager only): q / out / block_table as in
  // AttentionArgs; the cached K / V rows are gathered into dense_k /
  // dense_v (cudnn_kv_) per layer.
  struct CudnnSequence {
    CudnnSdpaShape shape;
    cuda_kernels::AttentionArgs a;
  };
  std::vector<CudnnSequence>* cudnn = nullptr;
  void* dense_k = nullptr;
  void* dense_v = nullptr;
  // Runs after each layer's RoPE (the query capture); may be empty.
  std::function<absl::Status(int layer)> after_rope;
  bool argmax = false;  // reduce the logit rows to reg->argmax
  bool edits = false;   // ApplyLogitEdits over the logit rows first
  int mask_words = 0;   // > 0: then ApplyTokenMasks (eager steps)
  PhaseTimer* timer = nullptr;  // times the phases (eager steps)
  // The last layer when rows nobody reads are pruned (eager steps; null:
  // it runs as every other): the per-sequence lists without the pruned
  // sequences, whose logit-row suffixes run on the split-K kernel instead;
  // then o_proj, the MLP and the final norm over the live rows only.
  struct LastLayer {
    std::vector<cuda_kernels::AttentionArgs> flash, flash_mma;
    std::vector<CudnnSequence> cudnn;
    std::vector<std::pair<cuda_kernels::AttentionArgs, int>> splitk;  // splits
    const int* live = nullptr;        // [nl] step rows the last layer computes
    int nl = 0;
    const int* logit_rows = nullptr;  // [r] the logit rows among them
  };
  const LastLayer* last = nullptr;
};

// A CUDA graph step's fixed device layout: the regions for kMaxGraphRows
// rows and the int inputs at fixed offsets inside reg.ints.
struct CudaModelRunner::GraphLayout {
  StepRegions reg;
  cuda_kernels::BatchedAttentionCapacity cap;  // at kMaxGraphRows
  int max_tables = 0;
  int* ids = nullptr;  // [kMaxGraphRows] each: ids, positions, slots, rows
  int* tables = nullptr;
  int* seq_info = nullptr;
  int* work = nullptr;
  int* combine = nullptr;
  int* counts = nullptr;  // [2]: the step's work and combine counts
};

absl::Status CudaModelRunner::EnqueueForward(const StepLaunch& s) {
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  const int hidden = c.hidden_size, H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim;
  const int ffn = c.intermediate_size, qkv_dim = c.qkv_dim();
  const int L = c.num_hidden_layers, vocab = c.vocab_size;
  const StepRegions& reg = *s.reg;
  const int N = s.n, R = s.r;
  cuda_kernels::BatchedAttentionArgs ba = s.ba;
  // The end of a phase's launches (PhaseTimer; nothing when untimed).
  const auto mark = [&](ForwardPhase phase) {
    return s.timer == nullptr ? absl::OkStatus()
                              : s.timer->Mark(phase, stream_);
  };
  if (s.timer != nullptr) SPECSERVE_RETURN_IF_ERROR(s.timer->Start(stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::EmbeddingGather(
      weights_->embed(), dt, s.ids, N, hidden, reg.x, stream_));
  SPECSERVE_RETURN_IF_ERROR(mark(kPhaseEmbed));
  for (int l = 0; l < L; ++l) {
    const CudaLayerWeights& w = weights_->layer(l);
    const StepLaunch::LastLayer* last = l == L - 1 ? s.last : nullptr;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
        reg.x, nullptr, N, hidden, w.attn_norm, c.rms_norm_eps, reg.xn, dt,
        stream_));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseNorm));
    SPECSERVE_RETURN_IF_ERROR(linear_.Run(Projection::kQkv, cublas_, stream_,
                                          dt, reg.xn, N, hidden, w.wqkv,
                                          qkv_dim, reg.qkv, CudaDType::kF32,
                                          0.0f));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseQkvProj));
    if (w.bqkv != nullptr) {  // Qwen2
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::AddBias(
          reg.qkv, qkv_dim, N, qkv_dim, w.bqkv, stream_));
    }
    if (w.q_norm != nullptr) {  // Qwen3: per-head RMSNorm before RoPE
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::HeadRmsNorm(
          reg.qkv, N, H, KV, D, w.q_norm, w.k_norm, c.rms_norm_eps, stream_));
    }
    cuda_kernels::RopeArgs rope;
    rope.qkv = reg.qkv;
    rope.n = N;
    rope.num_heads = H;
    rope.num_kv_heads = KV;
    rope.head_dim = D;
    rope.positions = s.positions;
    rope.theta = c.rope_theta;
    rope.inv_freq = weights_->rope_inv_freq();
    rope.attention_factor = weights_->rope_attention_factor();
    rope.q_out = reg.q;
    rope.k_cache = keys(l);
    rope.v_cache = values(l);
    rope.slots = s.slots;
    rope.dtype = dt;
    // Only a capture reads the rotated fp32 heads back from reg.qkv.
    rope.rotate_in_place = static_cast<bool>(s.after_rope);
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RopeQkvStore(rope, stream_));
    if (s.after_rope) SPECSERVE_RETURN_IF_ERROR(s.after_rope(l));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseRopeKvStore));
    const std::vector<cuda_kernels::AttentionArgs>* flash =
        last != nullptr ? &last->flash : s.flash;
    const std::vector<cuda_kernels::AttentionArgs>* flash_mma =
        last != nullptr ? &last->flash_mma : s.flash_mma;
    const std::vector<StepLaunch::CudnnSequence>* cudnn =
        last != nullptr ? &last->cudnn : s.cudnn;
    if (flash != nullptr) {
      for (cuda_kernels::AttentionArgs a : *flash) {
        a.k_cache = keys(l);
        a.v_cache = values(l);
        SPECSERVE_CUDA_RETURN_IF_ERROR(
            cuda_kernels::FlashAttention(a, stream_));
      }
    }
    if (flash_mma != nullptr) {
      for (cuda_kernels::AttentionArgs a : *flash_mma) {
        a.k_cache = keys(l);
        a.v_cache = values(l);
        SPECSERVE_CUDA_RETURN_IF_ERROR(
            cuda_kernels::FlashMmaAttention(a, stream_));
      }
    }
    if (last != nullptr) {
      for (auto [a, splits] : last->splitk) {
        a.k_cache = keys(l);
        a.v_cache = values(l);
        SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::SplitKAttention(
            a, splits, reg.splitk_ws, stream_));
      }
    }
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseAttention));  // not the gathers'
    if (cudnn != nullptr) {
      for (const StepLaunch::CudnnSequence& cs : *cudnn) {
        const cuda_kernels::AttentionArgs& a = cs.a;
        const int count = cs.shape.s_kv, width = KV * D;
        SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::GatherKvRows(
            keys(l), dt, a.block_table, a.block_size, count, width,
            s.dense_k, stream_));
        SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::GatherKvRows(
            values(l), dt, a.block_table, a.block_size, count, width,
            s.dense_v, stream_));
        SPECSERVE_RETURN_IF_ERROR(mark(kPhaseKvGather));
        SPECSERVE_RETURN_IF_ERROR(
            cudnn_->Run(cs.shape, a.q, s.dense_k, s.dense_v, a.out, a.scale));
        SPECSERVE_RETURN_IF_ERROR(mark(kPhaseAttention));
      }
    }
    ba.k_cache = keys(l);
    ba.v_cache = values(l);
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::BatchedAttention(ba, stream_));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseAttention));
    // The rest of the layer over its rows: all of them, or the last layer's
    // live rows, gathered.
    float* x = reg.x;
    void* attn_out = reg.attn;
    int rows = N;
    if (last != nullptr) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(
          cuda_kernels::GatherRows(reg.x, CudaDType::kF32, last->live,
                                   last->nl, hidden, reg.x_live, stream_));
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::GatherRows(
          reg.attn, dt, last->live, last->nl, H * D, reg.attn_live, stream_));
      SPECSERVE_RETURN_IF_ERROR(mark(kPhaseRowGather));
      x = reg.x_live;
      attn_out = reg.attn_live;
      rows = last->nl;
    }
    // o_proj with beta = 1: the residual add, into the fp32 stream.
    SPECSERVE_RETURN_IF_ERROR(linear_.Run(Projection::kO, cublas_, stream_,
                                          dt, attn_out, rows, H * D, w.wo,
                                          hidden, x, CudaDType::kF32, 1.0f));
    if (w.bo != nullptr) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(
          cuda_kernels::AddBias(x, hidden, rows, hidden, w.bo, stream_));
    }
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseOProj));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
        x, nullptr, rows, hidden, w.mlp_norm, c.rms_norm_eps, reg.xn, dt,
        stream_));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseNorm));
    SPECSERVE_RETURN_IF_ERROR(linear_.Run(Projection::kGateUp, cublas_,
                                          stream_, dt, reg.xn, rows, hidden,
                                          w.w_gate_up, 2 * ffn, reg.gu, dt,
                                          0.0f));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseGateUpProj));
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cuda_kernels::SiluMul(reg.gu, rows, ffn, reg.act, dt, stream_));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseSiluMul));
    SPECSERVE_RETURN_IF_ERROR(linear_.Run(Projection::kDown, cublas_, stream_,
                                          dt, reg.act, rows, ffn, w.w_down,
                                          hidden, x, CudaDType::kF32, 1.0f));
    SPECSERVE_RETURN_IF_ERROR(mark(kPhaseDownProj));
  }
  // Final norm and vocabulary projection for the requested rows only.
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::RmsNorm(
      s.last != nullptr ? reg.x_live : reg.x,
      s.last != nullptr ? s.last->logit_rows : s.logit_rows, R, hidden,
      weights_->final_norm(), c.rms_norm_eps, reg.xn, dt, stream_));
  SPECSERVE_RETURN_IF_ERROR(linear_.Run(Projection::kLmHead, cublas_, stream_,
                                        dt, reg.xn, R, hidden,
                                        weights_->lm_head(), vocab, reg.logits,
                                        CudaDType::kF32, 0.0f));
  if (s.edits) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ApplyLogitEdits(
        reg.logits, vocab, R, reg.edit_offsets, reg.edits, stream_));
  }
  if (s.mask_words > 0) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ApplyTokenMasks(
        reg.logits, vocab, R, reg.mask_of_row, reg.allowed, s.mask_words,
        stream_));
  }
  if (s.argmax) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ArgmaxRows(
        reg.logits, R, vocab, reg.argmax, stream_));
  }
  return mark(kPhaseLogits);
}

absl::Status CudaModelRunner::Run(
    absl::Span<const SequenceForward> batch,
    const std::vector<std::vector<int>>& logit_rows,
    const std::vector<int>& first, std::vector<ForwardOutput>* out) {
  absl::StatusOr<bool> graphed = RunGraphed(batch, logit_rows, first, out);
  if (!graphed.ok() || *graphed) return graphed.status();
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  const size_t tb = CudaDTypeBytes(dt);
  const int S = static_cast<int>(batch.size());
  const int H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim;
  const int qkv_dim = c.qkv_dim();
  const int L = c.num_hidden_layers, vocab = c.vocab_size;
  const size_t qrow = static_cast<size_t>(H) * D;
  const int bs = cache_->block_size();

  // Rows of all sequences, concatenated; per-sequence offsets of the logit
  // rows, the host-captured queries and the block tables.
  std::vector<int> row0(S + 1, 0), lr0(S + 1, 0), hq0(S + 1, 0), bt0(S + 1, 0);
  for (int i = 0; i < S; ++i) {
    const ForwardInput& in = batch[i].input;
    row0[i + 1] = row0[i] + static_cast<int>(in.token_ids.size());
    lr0[i + 1] = lr0[i] + static_cast<int>(logit_rows[i].size());
    hq0[i + 1] = hq0[i] + (batch[i].capture == nullptr
                               ? static_cast<int>(in.capture_query_rows.size())
                               : 0);
    bt0[i + 1] = bt0[i] + static_cast<int>(batch[i].kv->block_table().size());
  }
  const int N = row0[S], R = lr0[S], NQ = hq0[S];
  int capture_rows = 0;  // for the host and into captures
  for (const SequenceForward& e : batch) {
    capture_rows += static_cast<int>(e.input.capture_query_rows.size());
  }
  const size_t NN = N;

  // Attention: FlashAttention per sequence for long prefill chunks (kAuto;
  // FlashMmaAttention where it applies with kFlashMma) or everywhere
  // supported (kFlash); every other sequence of the step in ONE batched
  // launch per layer (decode rows, verify rows, short chunks).
  std::vector<cuda_kernels::AttentionArgs> attn(S);
  std::vector<bool> use_flash(S), use_mma(S), use_cudnn(S);
  size_t cudnn_kv_bytes = 0;
  std::vector<cuda_kernels::AttentionSequence> batched;
  for (int i = 0; i < S; ++i) {
    cuda_kernels::AttentionArgs& a = attn[i];
    a.dtype = dt;
    a.n = row0[i + 1] - row0[i];
    a.first = first[i];
    a.num_heads = H;
    a.num_kv_heads = KV;
    a.head_dim = D;
    a.scale = 1.0f / std::sqrt(static_cast<float>(D));
    a.block_size = bs;
    bool flash = cuda_kernels::FlashAttentionSupported(D, dt);
    const bool long_rows = a.n >= kFlashMinRows;
    if (attention_path_ == AttentionPath::kAuto ||
        attention_path_ == AttentionPath::kFlashMma ||
        attention_path_ == AttentionPath::kCudnn) {
      flash = flash && long_rows;
    } else if (attention_path_ == AttentionPath::kSplitK) {
      flash = false;
    }
    use_mma[i] = attention_path_ == AttentionPath::kFlashMma && long_rows &&
                 batch[i].input.tree_parents.empty() &&
                 cuda_kernels::FlashMmaSupported(D, dt);
    if (attention_path_ == AttentionPath::kCudnn && long_rows &&
        batch[i].input.tree_parents.empty()) {
      const CudnnSdpaShape shape{a.n, a.first + a.n, H, KV, D, dt};
      bool want = ValidateCudnnSdpaShape(shape).ok();
      // A shape with no plan yet runs on FlashMma until its plan pays off
      // (CudnnPlanPolicy: at once for full chunks and long tails, else
      // once the shape has recurred enough).
      if (want && !cudnn_plan_every_chunk_ &&
          cuda_kernels::FlashMmaSupported(D, dt) &&
          !(cudnn_ != nullptr && cudnn_->HasPlan(shape)) &&
          !cudnn_plan_policy_.ShouldPlan(shape, config().num_hidden_layers)) {
        want = false;
        use_mma[i] = true;
      }
      use_cudnn[i] = want && CudnnSupports(shape);
      if (use_cudnn[i]) {  // cuDNN reads the padded shape's keys
        cudnn_kv_bytes = std::max(
            cudnn_kv_bytes, tb * PaddedCudnnSdpaShape(shape).s_kv * KV * D);
      }
    }
    use_flash[i] = flash && !use_mma[i] && !use_cudnn[i];
    if (!use_flash[i] && !use_mma[i] && !use_cudnn[i]) {
      batched.push_back({a.n, a.first, bt0[i], row0[i]});
    }
  }
  absl::StatusOr<cuda_kernels::BatchedAttentionPlan> plan =
      cuda_kernels::PlanBatchedAttention(batched, H, KV, num_sms_);
  if (!plan.ok()) return plan.status();
  const size_t plan_ints =
      plan->seq_info.size() + plan->work.size() + plan->combine.size();

  // The last layer's rows nobody reads. A long chunk (a per-sequence
  // kernel's) whose logit rows are its last k <= kPrunedMaxRows rows needs
  // the last layer's attention, o_proj and MLP for those k rows only:
  // every row's K / V is stored before attention, capture rows are taken
  // after RoPE, and the logits read the logit rows alone. For a long
  // prefill that is one layer in num_hidden_layers of the forward.
  // live_from[i]: sequence i's first row the last layer computes.
  std::vector<int> live_from(S, 0);
  bool prune = false;
  for (int i = 0; i < S; ++i) {
    if ((!use_flash[i] && !use_mma[i] && !use_cudnn[i]) ||
        !batch[i].input.tree_parents.empty() || logit_rows[i].empty()) {
      continue;
    }
    const int n = row0[i + 1] - row0[i];
    const int m =
        *std::min_element(logit_rows[i].begin(), logit_rows[i].end());
    if (m > 0 && n - m <= kPrunedMaxRows) {
      live_from[i] = m;
      prune = true;
    }
  }
  // Sequence i's suffix from live_from[i] on, as attention args: its rows,
  // after the rows before them (q / out / tree pointers moved once set).
  const auto suffix = [&](int i) {
    cuda_kernels::AttentionArgs a = attn[i];
    const int skip = live_from[i];
    if (a.q != nullptr) {
      a.q = static_cast<const char*>(a.q) + tb * skip * qrow;
      a.out = static_cast<char*>(a.out) + tb * skip * qrow;
    }
    if (a.tree_start != nullptr) {  // a tree elsewhere in the step
      a.tree_start += skip;
      a.tree_mask += skip;
    }
    a.n -= skip;
    a.first += skip;
    return a;
  };
  // The live rows (each sequence's from live_from[i] on) and each logit
  // row's index among them.
  std::vector<int> live, live_logit;
  std::vector<int> suffix_splits(S, 0);  // split-K splits of a suffix
  size_t splitk_ws_bytes = 0;
  if (prune) {
    live_logit.resize(R);
    for (int i = 0; i < S; ++i) {
      const int start = static_cast<int>(live.size());
      for (int t = row0[i] + live_from[i]; t < row0[i + 1]; ++t) {
        live.push_back(t);
      }
      for (size_t j = 0; j < logit_rows[i].size(); ++j) {
        live_logit[lr0[i] + j] = start + logit_rows[i][j] - live_from[i];
      }
      if (live_from[i] == 0) continue;
      // The suffixes' launches run one after another on the stream and
      // share one workspace.
      const cuda_kernels::AttentionArgs a = suffix(i);
      suffix_splits[i] = cuda_kernels::SplitKAttentionSplits(a, num_sms_);
      splitk_ws_bytes = std::max(
          splitk_ws_bytes,
          cuda_kernels::SplitKAttentionWorkspaceBytes(a, suffix_splits[i]));
    }
  }
  const int NL = static_cast<int>(live.size());

  // Tree attention (ForwardInput::tree_parents) in the kernels' bit form.
  std::vector<int> host_tree_start;
  std::vector<uint64_t> host_tree_mask;
  for (int i = 0; i < S; ++i) {
    const std::vector<int>& parents = batch[i].input.tree_parents;
    if (parents.empty()) continue;
    if (host_tree_start.empty()) {
      host_tree_start.assign(N, std::numeric_limits<int>::max());
      host_tree_mask.assign(N, ~uint64_t{0});
    }
    TreeSpanBits(parents, first[i], row0[i + 1] - row0[i],
                 host_tree_start.data() + row0[i],
                 host_tree_mask.data() + row0[i]);
  }
  const size_t tree_rows = host_tree_start.empty() ? 0 : NN;

  // The row-sampling job of every sequence that asked for it.
  const cuda_step::PackedRowSampling samp =
      cuda_step::PackRowSampling(batch, lr0);
  const int NS = samp.num_rows;
  // Every sequence's logit edits, over the step's logit rows.
  const LogitEdits edits = cuda_step::PackLogitEdits(batch, lr0, R);

  StepSizes sizes;
  sizes.rows = NN;
  sizes.logit_rows = R;
  sizes.captured_rows = NQ;
  sizes.capture_slots = capture_rows;
  sizes.ints = 3 * NN + R + bt0[S] + plan_ints + (prune ? NL + R : 0);
  sizes.split_ws_bytes = cuda_kernels::BatchedAttentionWorkspaceBytes(*plan, D);
  sizes.live_rows = NL;
  sizes.splitk_ws_bytes = splitk_ws_bytes;
  sizes.tree_rows = tree_rows;
  sizes.samp_rows = NS;
  sizes.samp_ints = samp.ints.size();
  sizes.samp_floats = samp.floats.size();
  sizes.edit_rows = edits.offsets.empty() ? 0 : R;
  sizes.edits = edits.edits.size();
  sizes.mask_rows = edits.mask_of_row.size();
  sizes.mask_words = edits.allowed.size();
  StepRegions reg;
  SPECSERVE_RETURN_IF_ERROR(
      workspace_.Reserve(CarveStep(nullptr, c, tb, sizes, &reg)));
  CarveStep(workspace_.as<char>(), c, tb, sizes, &reg);
  int* d_ids = reg.ints;
  int* d_pos = reg.ints + N;
  int* d_slots = reg.ints + 2 * N;
  int* d_rows = reg.ints + 3 * N;
  int* d_tables = reg.ints + 3 * N + R;
  int* d_plan = d_tables + bt0[S];

  std::vector<int> host_ints(sizes.ints);
  for (int i = 0; i < S; ++i) {
    const ForwardInput& in = batch[i].input;
    const int n = row0[i + 1] - row0[i];
    for (int t = 0; t < n; ++t) {
      host_ints[row0[i] + t] = in.token_ids[t];
      host_ints[N + row0[i] + t] = in.position_ids[t];
      host_ints[2 * N + row0[i] + t] = batch[i].kv->PhysicalSlot(first[i] + t);
    }
    for (size_t j = 0; j < logit_rows[i].size(); ++j) {
      host_ints[3 * N + lr0[i] + j] = row0[i] + logit_rows[i][j];
    }
    const std::vector<int>& table = batch[i].kv->block_table();
    std::copy(table.begin(), table.end(),
              host_ints.begin() + 3 * N + R + bt0[i]);
    attn[i].block_table = d_tables + bt0[i];
    if (tree_rows > 0) {
      attn[i].tree_start = reg.tree_start + row0[i];
      attn[i].tree_mask = reg.tree_mask + row0[i];
    }
    attn[i].q = static_cast<char*>(reg.q) + tb * row0[i] * qrow;
    attn[i].out = static_cast<char*>(reg.attn) + tb * row0[i] * qrow;
  }
  int* host_plan = host_ints.data() + 3 * N + R + bt0[S];
  host_plan =
      std::copy(plan->seq_info.begin(), plan->seq_info.end(), host_plan);
  host_plan = std::copy(plan->work.begin(), plan->work.end(), host_plan);
  host_plan = std::copy(plan->combine.begin(), plan->combine.end(), host_plan);
  int* d_live = d_plan + plan_ints;
  host_plan = std::copy(live.begin(), live.end(), host_plan);
  std::copy(live_logit.begin(), live_logit.end(), host_plan);
  StepLaunch step;
  step.reg = &reg;
  step.n = N;
  step.r = R;
  step.ids = d_ids;
  step.positions = d_pos;
  step.slots = d_slots;
  step.logit_rows = d_rows;
  cuda_kernels::BatchedAttentionArgs& ba = step.ba;
  ba = BatchedArgs(reg, c, dt, bs);
  ba.block_tables = d_tables;
  ba.seq_info = d_plan;
  ba.work = d_plan + plan->seq_info.size();
  ba.num_work = plan->num_work();
  ba.combine = ba.work + plan->work.size();
  ba.num_combine = plan->num_combine();
  ba.partial_triples = plan->partial_triples;
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      reg.ints, host_ints.data(), sizeof(int) * host_ints.size(),
      cudaMemcpyHostToDevice, stream_));
  SPECSERVE_RETURN_IF_ERROR(UploadSampling(samp, reg, stream_));
  if (!edits.offsets.empty()) {
    SPECSERVE_RETURN_IF_ERROR(UploadEdits(edits, reg, stream_));
    step.edits = true;
    if (edits.has_masks()) step.mask_words = edits.mask_words;
  }
  if (tree_rows > 0) {
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
    ba.tree_start = reg.tree_start;
    ba.tree_mask = reg.tree_mask;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.tree_start, host_tree_start.data(), sizeof(int) * tree_rows,
        cudaMemcpyHostToDevice, stream_));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.tree_mask, host_tree_mask.data(), sizeof(uint64_t) * tree_rows,
        cudaMemcpyHostToDevice, stream_));
  }
  std::vector<cuda_kernels::AttentionArgs> flash, flash_mma;
  StepLaunch::LastLayer last;
  for (int i = 0; i < S; ++i) {
    if (use_flash[i]) flash.push_back(attn[i]);
    if (use_mma[i]) flash_mma.push_back(attn[i]);
    if (live_from[i] == 0) {
      if (use_flash[i]) last.flash.push_back(attn[i]);
      if (use_mma[i]) last.flash_mma.push_back(attn[i]);
      continue;
    }
    last.splitk.push_back({suffix(i), suffix_splits[i]});
  }
  step.flash = &flash;
  step.flash_mma = &flash_mma;
  if (prune) {
    last.live = d_live;
    last.nl = NL;
    last.logit_rows = d_live + NL;
    step.last = &last;
  }
  std::vector<StepLaunch::CudnnSequence> cudnn_seqs;
  if (cudnn_kv_bytes > 0) {
    // Two dense planes, K then V, 256-byte aligned.
    const size_t plane = AlignDeviceBytes(cudnn_kv_bytes);
    SPECSERVE_RETURN_IF_ERROR(cudnn_kv_.Reserve(2 * plane));
    step.dense_k = cudnn_kv_.get();
    step.dense_v = cudnn_kv_.as<char>() + plane;
    for (int i = 0; i < S; ++i) {
      if (!use_cudnn[i]) continue;
      const cuda_kernels::AttentionArgs& a = attn[i];
      cudnn_seqs.push_back(
          {CudnnSdpaShape{a.n, a.first + a.n, H, KV, D, dt}, a});
      if (live_from[i] == 0) last.cudnn.push_back(cudnn_seqs.back());
    }
    step.cudnn = &cudnn_seqs;
  }
  // Post-RoPE fp32 queries of the capture rows (q heads lead each row):
  // one launch a layer, as in a graph. (The slots stay alive until the
  // step's end: the copy may read them late.)
  const std::vector<cuda_kernels::CaptureSlot> slots =
      CaptureSlots(batch, reg.captured, NQ);
  if (capture_rows > 0) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        reg.capture_slots, slots.data(),
        sizeof(cuda_kernels::CaptureSlot) * slots.size(),
        cudaMemcpyHostToDevice, stream_));
    step.after_rope = [&](int l) -> absl::Status {
      SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::CaptureQueryRows(
          reg.qkv, qkv_dim, static_cast<int>(qrow), reg.capture_slots,
          capture_rows, l, stream_));
      return absl::OkStatus();
    };
  }
  // argmax_only sequences get their rows' ids, reduced on the device;
  // sampling ones each row's token and accept flag, sampled on the device;
  // the others their fp32 logits. Only what is read crosses to the host.
  bool any_argmax = false, any_logits = false;
  for (int i = 0; i < S; ++i) {
    any_argmax |= batch[i].input.argmax_only;
    any_logits |=
        !batch[i].input.argmax_only && batch[i].input.sampling == nullptr;
  }
  step.argmax = any_argmax;
  if (phase_timing_) step.timer = &phase_timer_;
  SPECSERVE_RETURN_IF_ERROR(EnqueueForward(step));

  std::vector<int> samp_out(2 * NS);
  if (NS > 0) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::SampleRows(
        SampleArgs(reg, NS, NS, vocab), stream_));
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(samp_out.data(), reg.samp_out, sizeof(int) * 2 * NS,
                        cudaMemcpyDeviceToHost, stream_));
  }
  std::vector<int> argmax(any_argmax ? R : 0);
  if (any_argmax) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(argmax.data(), reg.argmax, sizeof(int) * R,
                        cudaMemcpyDeviceToHost, stream_));
  }
  std::vector<float> logits(any_logits ? static_cast<size_t>(R) * vocab : 0);
  for (int i = 0; i < S; ++i) {
    if (batch[i].input.argmax_only || batch[i].input.sampling != nullptr ||
        lr0[i + 1] == lr0[i]) {
      continue;
    }
    const size_t at = static_cast<size_t>(lr0[i]) * vocab;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        logits.data() + at, reg.logits + at,
        sizeof(float) * (lr0[i + 1] - lr0[i]) * vocab,
        cudaMemcpyDeviceToHost, stream_));
  }
  std::vector<float> queries(static_cast<size_t>(L) * NQ * qrow);
  if (!queries.empty()) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        queries.data(), reg.captured, sizeof(float) * queries.size(),
        cudaMemcpyDeviceToHost, stream_));
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (step.timer != nullptr) SPECSERVE_RETURN_IF_ERROR(step.timer->Collect());

  // Logprobs (ForwardInput::logprobs_top_n) of the tokens just decided, on
  // the device: [rows, 1 + 2 * top_n] values come back, not the logits.
  std::vector<TokenLogprobs> row_logprobs;
  SPECSERVE_RETURN_IF_ERROR(
      RowLogprobsOnDevice(batch, lr0, argmax, samp_out, NS, reg.logits,
                          &row_logprobs));

  out->assign(S, ForwardOutput());
  int samp_next = 0;
  for (int i = 0; i < S; ++i) {
    ForwardOutput& o = (*out)[i];
    o.logit_rows = logit_rows[i];
    if (batch[i].input.logprobs_top_n >= 0) {
      const int top_n = batch[i].input.logprobs_top_n;
      for (int r = lr0[i]; r < lr0[i + 1]; ++r) {
        TokenLogprobs lp = std::move(row_logprobs[r]);
        if (static_cast<int>(lp.top.size()) > top_n) lp.top.resize(top_n);
        o.token_logprobs.push_back(std::move(lp));
      }
    }
    if (batch[i].input.argmax_only) {
      o.argmax.assign(argmax.begin() + lr0[i], argmax.begin() + lr0[i + 1]);
    } else if (batch[i].input.sampling != nullptr) {
      const int rows = lr0[i + 1] - lr0[i];
      o.sampled.assign(samp_out.begin() + samp_next,
                       samp_out.begin() + samp_next + rows);
      o.accepted.assign(samp_out.begin() + NS + samp_next,
                        samp_out.begin() + NS + samp_next + rows);
      samp_next += rows;
    } else {
      o.logits.assign(logits.begin() + static_cast<size_t>(lr0[i]) * vocab,
                      logits.begin() + static_cast<size_t>(lr0[i + 1]) * vocab);
    }
    const int nq = static_cast<int>(batch[i].input.capture_query_rows.size());
    if (batch[i].capture != nullptr) {
      static_cast<CudaQueryCapture*>(batch[i].capture)->rows_ += nq;
    } else if (nq > 0) {
      o.queries.resize(static_cast<size_t>(L) * nq * qrow);
      for (int l = 0; l < L; ++l) {
        std::copy_n(
            queries.begin() + (static_cast<size_t>(l) * NQ + hq0[i]) * qrow,
            nq * qrow, o.queries.begin() + static_cast<size_t>(l) * nq * qrow);
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The graph workspace's regions (kMaxGraphRows rows; the attention
// capacity for `num_sms`), and the table room in *max_tables.
StepSizes GraphStepSizes(const ModelConfig& c, int block_size, int num_sms,
                         cuda_kernels::BatchedAttentionCapacity* cap,
                         int* max_tables) {
  constexpr int kRows = CudaModelRunner::kMaxGraphRows;
  *cap = cuda_kernels::BatchedAttentionCapacityFor(
      kRows, kRows, c.num_attention_heads, c.num_key_value_heads, num_sms);
  // Every sequence's table is at most its capacity's blocks.
  *max_tables =
      kRows * ((c.max_position_embeddings + block_size - 1) / block_size);
  const size_t Nm = kRows;
  StepSizes sizes;
  sizes.rows = Nm;
  sizes.logit_rows = Nm;
  sizes.ints = 4 * Nm + *max_tables + Nm * cuda_kernels::kSeqInfoFields +
               3 * static_cast<size_t>(cap->num_work) +
               2 * static_cast<size_t>(cap->num_combine) + 2;
  sizes.split_ws_bytes = sizeof(float) *
                         static_cast<size_t>(cap->partial_triples) *
                         (c.head_dim + 2);
  // SampleRows jobs, PackRowSampling's layout with stride kMaxGraphRows.
  sizes.samp_rows = Nm;
  sizes.samp_ints = 4 * Nm + 1 + CudaModelRunner::kGraphMaxDraftQ;
  sizes.samp_floats = 3 * Nm + CudaModelRunner::kGraphMaxDraftQ;
  sizes.edit_rows = Nm;
  sizes.edits = CudaModelRunner::kGraphMaxLogitEdits;
  sizes.capture_slots = CudaModelRunner::kGraphMaxCaptureRows;
  return sizes;
}

}  // namespace

size_t CudaModelRunner::GraphWorkspaceBytes(const ModelConfig& config,
                                            CudaDType dtype, int block_size,
                                            int num_sms) {
  cuda_kernels::BatchedAttentionCapacity cap;
  int max_tables = 0;
  const StepSizes sizes = GraphStepSizes(config, std::max(block_size, 1),
                                         num_sms, &cap, &max_tables);
  StepRegions reg;
  return CarveStep(nullptr, config, CudaDTypeBytes(dtype), sizes, &reg);
}

absl::Status CudaModelRunner::AllocateGraphLayout() {
  const ModelConfig& c = config();
  auto gl = std::make_unique<GraphLayout>();
  const StepSizes sizes = GraphStepSizes(c, cache_->block_size(), num_sms_,
                                         &gl->cap, &gl->max_tables);
  const size_t Nm = kMaxGraphRows;
  const size_t tb = CudaDTypeBytes(weights_->dtype());
  absl::StatusOr<DeviceBuffer> ws =
      DeviceBuffer::Allocate(CarveStep(nullptr, c, tb, sizes, &gl->reg));
  if (!ws.ok()) return ws.status();
  graph_workspace_ = *std::move(ws);
  CarveStep(graph_workspace_.as<char>(), c, tb, sizes, &gl->reg);
  gl->ids = gl->reg.ints;
  gl->tables = gl->ids + 4 * Nm;
  gl->seq_info = gl->tables + gl->max_tables;
  gl->work = gl->seq_info + Nm * cuda_kernels::kSeqInfoFields;
  gl->combine = gl->work + 3 * static_cast<size_t>(gl->cap.num_work);
  gl->counts = gl->combine + 2 * static_cast<size_t>(gl->cap.num_combine);
  // Every graph edits its logit rows (ApplyLogitEdits): no edits until a
  // step brings some.
  LogitEdits none;
  none.offsets.assign(Nm + 1, 0);
  SPECSERVE_RETURN_IF_ERROR(UploadEdits(none, gl->reg, stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  graph_edits_live_ = false;
  graph_layout_ = std::move(gl);
  return absl::OkStatus();
}

std::vector<cuda_kernels::CaptureSlot> CudaModelRunner::CaptureSlots(
    absl::Span<const SequenceForward> batch, float* host, int host_rows) {
  const ModelConfig& c = config();
  const size_t qrow = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  std::vector<cuda_kernels::CaptureSlot> slots;
  int row = 0, host_row = 0;
  for (const SequenceForward& e : batch) {
    auto* cap = static_cast<CudaQueryCapture*>(e.capture);
    const std::vector<int>& rows = e.input.capture_query_rows;
    for (size_t j = 0; j < rows.size(); ++j) {
      cuda_kernels::CaptureSlot slot;
      if (cap != nullptr) {
        slot.dst = cap->mutable_layer_queries(0) + (cap->rows() + j) * qrow;
        slot.layer_stride = static_cast<long long>(cap->max_rows()) * qrow;
      } else {
        slot.dst = host + static_cast<size_t>(host_row++) * qrow;
        slot.layer_stride = static_cast<long long>(host_rows) * qrow;
      }
      slot.row = row + rows[j];
      slots.push_back(slot);
    }
    row += static_cast<int>(e.input.token_ids.size());
  }
  return slots;
}

absl::StatusOr<bool> CudaModelRunner::RunGraphed(
    absl::Span<const SequenceForward> batch,
    const std::vector<std::vector<int>>& logit_rows,
    const std::vector<int>& first, std::vector<ForwardOutput>* out) {
  if (!cuda_graphs_ || attention_path_ == AttentionPath::kFlash) return false;
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  const int S = static_cast<int>(batch.size());
  // Sequences with kFlashMinRows rows or more go to a FlashAttention
  // kernel (kAuto, kFlashMma), launched per sequence.
  const bool any_flash =
      cuda_kernels::FlashAttentionSupported(c.head_dim, dt) ||
      (attention_path_ == AttentionPath::kFlashMma &&
       cuda_kernels::FlashMmaSupported(c.head_dim, dt));
  const int flash_min_rows =
      attention_path_ != AttentionPath::kSplitK && any_flash ? kFlashMinRows
                                                             : 0;
  if (!cuda_step::GraphEligible(batch, logit_rows, kMaxGraphRows,
                                flash_min_rows, kGraphMaxDraftQ,
                                kGraphMaxLogitEdits, kGraphMaxCaptureRows)) {
    return false;
  }
  const bool sampled = cuda_step::AnySampling(batch);
  if (graph_layout_ == nullptr) {
    if (absl::Status s = AllocateGraphLayout(); !s.ok()) {
      // No room for the graphs' fixed workspace: run eagerly from now on.
      std::fprintf(stderr, "cuda graphs off: %s\n",
                   std::string(s.message()).c_str());
      cuda_graphs_ = false;
      return false;
    }
  }
  const GraphLayout& gl = *graph_layout_;
  const int H = c.num_attention_heads, KV = c.num_key_value_heads;
  const size_t Nm = kMaxGraphRows;
  // Inputs at the layout's fixed offsets; padding rows take token 0 at
  // position 0, store no KV (slot -1) and attend to nothing.
  absl::StatusOr<cuda_step::GraphStepInputs> in = cuda_step::PackGraphStep(
      batch, first, kMaxGraphRows, gl.max_tables, H, KV, num_sms_);
  if (!in.ok()) return false;  // tables beyond the graph's room: eager
  const int N = in->rows, b = in->bucket;
  const cuda_kernels::BatchedAttentionPlan& plan = in->plan;
  const cuda_kernels::BatchedAttentionCapacity cap =
      cuda_kernels::BatchedAttentionCapacityFor(b, b, H, KV, num_sms_);
  if (plan.num_work() > cap.num_work || plan.num_combine() > cap.num_combine ||
      plan.partial_triples > gl.cap.partial_triples) {
    return false;  // BatchedAttentionCapacityFor's bound broken: stay eager
  }
  const int counts[2] = {plan.num_work(), plan.num_combine()};
  auto upload = [&](int* dst, const int* src, size_t n) -> absl::Status {
    if (n == 0) return absl::OkStatus();
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dst, src, sizeof(int) * n, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  };
  SPECSERVE_RETURN_IF_ERROR(upload(gl.ids, in->head.data(), in->head.size()));
  SPECSERVE_RETURN_IF_ERROR(
      upload(gl.tables, in->tables.data(), in->tables.size()));
  SPECSERVE_RETURN_IF_ERROR(
      upload(gl.seq_info, plan.seq_info.data(), plan.seq_info.size()));
  SPECSERVE_RETURN_IF_ERROR(upload(gl.work, plan.work.data(), plan.work.size()));
  SPECSERVE_RETURN_IF_ERROR(
      upload(gl.combine, plan.combine.data(), plan.combine.size()));
  SPECSERVE_RETURN_IF_ERROR(upload(gl.counts, counts, 2));
  // Every logit row is a graph row: job r samples / edits row r.
  std::vector<int> lr0(S + 1, 0);
  for (int i = 0; i < S; ++i) {
    lr0[i + 1] = lr0[i] + static_cast<int>(logit_rows[i].size());
  }
  // The graph reads offsets [0, b]: this step's edits, or (once, after a
  // step with edits) zeros for every row a later bucket may read.
  LogitEdits edits = cuda_step::PackLogitEdits(batch, lr0, b);
  if (edits.has_masks()) {  // GraphEligible sends those steps eager
    return absl::InternalError("a graph step with token masks");
  }
  if (!edits.offsets.empty() || graph_edits_live_) {
    graph_edits_live_ = !edits.offsets.empty();
    if (!graph_edits_live_) edits.offsets.assign(Nm + 1, 0);
    SPECSERVE_RETURN_IF_ERROR(UploadEdits(edits, gl.reg, stream_));
  }
  if (sampled) {
    SPECSERVE_RETURN_IF_ERROR(UploadSampling(
        cuda_step::PackRowSampling(batch, lr0, kMaxGraphRows), gl.reg,
        stream_));
  }
  // Query capture (GraphEligible: device captures only, no sampled rows).
  std::vector<cuda_kernels::CaptureSlot> slots =
      CaptureSlots(batch, /*host=*/nullptr, 0);
  const bool captures = !slots.empty();
  if (captures) {
    slots.resize(kGraphMaxCaptureRows);  // unused slots: row -1
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        gl.reg.capture_slots, slots.data(),
        sizeof(cuda_kernels::CaptureSlot) * slots.size(),
        cudaMemcpyHostToDevice, stream_));
  }

  // Greedy steps, steps with sampled rows and greedy steps that capture
  // queries have a graph each per bucket.
  cudaGraphExec_t& exec =
      (sampled ? sampled_graphs_ : captures ? capture_graphs_ : graphs_)[b];
  if (exec == nullptr) {
    StepLaunch step;
    step.reg = &gl.reg;
    step.n = b;
    step.r = b;
    step.ids = gl.ids;
    step.positions = gl.ids + Nm;
    step.slots = gl.ids + 2 * Nm;
    step.logit_rows = gl.ids + 3 * Nm;
    step.argmax = true;
    step.edits = true;
    if (captures) {
      // Every layer's post-RoPE queries of the slots' rows, as the eager
      // step's copies (a launch a layer, whatever the rows).
      step.after_rope = [&](int l) -> absl::Status {
        SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::CaptureQueryRows(
            gl.reg.qkv, c.qkv_dim(), H * c.head_dim, gl.reg.capture_slots,
            kGraphMaxCaptureRows, l, stream_));
        return absl::OkStatus();
      };
    }
    cuda_kernels::BatchedAttentionArgs& ba = step.ba;
    ba = BatchedArgs(gl.reg, c, dt, cache_->block_size());
    ba.block_tables = gl.tables;
    ba.seq_info = gl.seq_info;
    ba.work = gl.work;
    ba.num_work = cap.num_work;
    ba.combine = gl.combine;
    ba.num_combine = cap.num_combine;
    ba.partial_triples = gl.cap.partial_triples;
    ba.device_counts = gl.counts;
    // Capture only records the launches; the replay below runs them. Any
    // failure leaves the stream out of capture mode and the runner eager.
    std::string why;
    const cudaError_t began =
        cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (began != cudaSuccess) {
      why = cudaGetErrorString(began);
    } else {
      absl::Status enqueued = EnqueueForward(step);
      if (enqueued.ok() && sampled) {
        // Every row of the bucket gets a job (placeholders for greedy and
        // padding rows), at the fixed offsets PackRowSampling fills.
        const cudaError_t launched = cuda_kernels::SampleRows(
            SampleArgs(gl.reg, kMaxGraphRows, b, c.vocab_size), stream_);
        if (launched != cudaSuccess) {
          enqueued = absl::InternalError(cudaGetErrorString(launched));
        }
      }
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
      if (!enqueued.ok()) {
        why = std::string(enqueued.message());
      } else if (ended != cudaSuccess) {
        why = cudaGetErrorString(ended);
      } else if (const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
                 made != cudaSuccess) {
        why = cudaGetErrorString(made);
      }
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    if (!why.empty()) {
      exec = nullptr;
      cudaGetLastError();
      std::fprintf(stderr, "cuda graphs off: capturing %d rows failed: %s\n",
                   b, why.c_str());
      cuda_graphs_ = false;
      return false;
    }
    // One line per captured graph (at most two per bucket), as vLLM logs
    // its captures: shows in a service's log which buckets serve from
    // graphs.
    std::fprintf(stderr, "cuda graph captured: %d-row bucket, %s\n", b,
                 sampled    ? "sampled"
                 : captures ? "greedy with query capture"
                            : "greedy");
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream_));
  std::vector<int> argmax(N), samp_out(sampled ? 2 * Nm : 0);
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(argmax.data(), gl.reg.argmax, sizeof(int) * N,
                      cudaMemcpyDeviceToHost, stream_));
  if (sampled) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        samp_out.data(), gl.reg.samp_out, sizeof(int) * samp_out.size(),
        cudaMemcpyDeviceToHost, stream_));
  }
  out->assign(S, ForwardOutput());
  // Sequences that asked for logits get their rows of the graph's logits
  // (fp32, [bucket, vocab]), in the same wait as the ids.
  const size_t vocab = c.vocab_size;
  for (int i = 0, row = 0; i < S; ++i) {
    const int n = static_cast<int>(logit_rows[i].size());
    const ForwardInput& in = batch[i].input;
    if (!in.argmax_only && in.sampling == nullptr) {
      std::vector<float>& logits = (*out)[i].logits;
      logits.resize(n * vocab);
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          logits.data(), gl.reg.logits + row * vocab,
          sizeof(float) * n * vocab, cudaMemcpyDeviceToHost, stream_));
    }
    row += n;
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  int row = 0;
  for (int i = 0; i < S; ++i) {
    ForwardOutput& o = (*out)[i];
    o.logit_rows = logit_rows[i];
    const int n = static_cast<int>(logit_rows[i].size());
    const ForwardInput& in = batch[i].input;
    if (in.sampling != nullptr) {
      o.sampled.assign(samp_out.begin() + row, samp_out.begin() + row + n);
      o.accepted.assign(samp_out.begin() + Nm + row,
                        samp_out.begin() + Nm + row + n);
    } else if (in.argmax_only) {
      o.argmax.assign(argmax.begin() + row, argmax.begin() + row + n);
    }
    if (batch[i].capture != nullptr) {
      static_cast<CudaQueryCapture*>(batch[i].capture)->rows_ +=
          static_cast<int>(in.capture_query_rows.size());
    }
    row += n;
  }
  ++graph_replays_;
  return true;
}

absl::StatusOr<ImportanceResult> CudaModelRunner::ScoreImportance(
    const KvSequence& kv, int prompt_len, const QueryCapture& capture,
    const ScoringOptions& options, int /*num_threads*/) {
  const auto* cap = dynamic_cast<const CudaQueryCapture*>(&capture);
  if (absl::Status s = ValidateScoringInput(cap, kv, prompt_len); !s.ok()) {
    return s;
  }
  const ModelConfig& c = config();
  const CudaDType dt = weights_->dtype();
  absl::MutexLock lock(&mu_);
  // Everything the scoring needs lives in the step workspace, free between
  // forwards (the stream orders it after the last step and before the
  // next): the block table, the prompt's keys of one layer gathered from
  // the sequence's blocks, and CudaImportance's buffers. No cudaMalloc /
  // cudaFree per prompt (cudaFree waits for the whole device).
  const size_t table_bytes = sizeof(int) * kv.block_table().size();
  const auto carve = [&](char* base, int** table, void** dense,
                         void** scratch) {
    DeviceCarver cv(base);
    *table = static_cast<int*>(cv.Take(table_bytes));
    *dense = cv.Take(static_cast<size_t>(prompt_len) * row_width_ *
                     CudaDTypeBytes(dt));
    *scratch = cv.Take(CudaImportance::ScratchBytes(prompt_len, cap->rows(),
                                                    c.num_attention_heads));
    return cv.size();
  };
  int* d_table = nullptr;
  void *dense = nullptr, *scratch = nullptr;
  SPECSERVE_RETURN_IF_ERROR(
      workspace_.Reserve(carve(nullptr, &d_table, &dense, &scratch)));
  carve(workspace_.as<char>(), &d_table, &dense, &scratch);
  absl::StatusOr<std::unique_ptr<CudaImportance>> imp = CudaImportance::Create(
      prompt_len, cap->rows(), c.num_attention_heads, c.num_key_value_heads,
      c.head_dim, c.num_hidden_layers, options, stream_, scratch);
  if (!imp.ok()) return imp.status();
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_table, kv.block_table().data(), table_bytes,
                      cudaMemcpyHostToDevice, stream_));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!(*imp)->UsesLayer(l)) continue;
    SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::GatherKvRows(
        keys(l), dt, d_table, cache_->block_size(), prompt_len, row_width_,
        dense, stream_));
    SPECSERVE_RETURN_IF_ERROR(
        (*imp)->AddLayer(l, cap->layer_queries(l), dense, dt, row_width_));
  }
  ImportanceResult result;
  absl::StatusOr<std::vector<std::vector<float>>> per_row =
      (*imp)->PerRowImportance();
  if (!per_row.ok()) return per_row.status();
  absl::StatusOr<std::vector<float>> importance = (*imp)->Importance();
  if (!importance.ok()) return importance.status();
  result.importance = *std::move(importance);
  result.per_row_importance = *std::move(per_row);
  return result;
}

}  // namespace specserve
