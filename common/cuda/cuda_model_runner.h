#ifndef SPECSERVE_COMMON_CUDA_CUDA_MODEL_RUNNER_H_
#define SPECSERVE_COMMON_CUDA_CUDA_MODEL_RUNNER_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/cudnn_attention.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/cuda/linear.h"
#include "common/cuda/phase_timer.h"
#include "common/cuda/prefill_tuning.h"
#include "common/cuda/skinny_linear.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner.h"

namespace specserve {

/// Post-RoPE queries of Speculative Prefill's scoring rows, kept on the
/// device across forward passes (the last prompt row from the prefill, then
/// one row per look-ahead decode step) so that the device reduction can
/// score them without a round trip through the host.
class CudaQueryCapture : public QueryCapture {
 public:
  /// Room for `max_rows` rows of a model with `config`'s shape.
  /// INVALID_ARGUMENT if max_rows < 1; RESOURCE_EXHAUSTED / INTERNAL from
  /// cudaMalloc.
  static absl::StatusOr<std::unique_ptr<CudaQueryCapture>> Create(
      const ModelConfig& config, int max_rows);

  int rows() const override { return rows_; }
  int max_rows() const override { return max_rows_; }
  void Clear() override { rows_ = 0; }
  /// Synchronous copy; CUDA errors as INTERNAL.
  absl::StatusOr<std::vector<float>> CopyToHost() const override;

  int num_layers() const { return num_layers_; }
  int num_heads() const { return num_heads_; }
  int head_dim() const { return head_dim_; }
  /// Device fp32 [max_rows, num_heads, head_dim] of layer `layer`; rows
  /// [0, rows()) are valid.
  const float* layer_queries(int layer) const;

 private:
  friend class CudaModelRunner;
  CudaQueryCapture() = default;
  float* mutable_layer_queries(int layer) const;

  int rows_ = 0;
  int max_rows_ = 0;
  int num_layers_ = 0;
  int num_heads_ = 0;
  int head_dim_ = 0;
  DeviceBuffer storage_;  // [layers][max_rows][heads][head_dim]
};

/// CUDA backend of ModelRunner with the CPU runner's semantics
/// (common/engine/cpu_model_runner.h; HF LlamaForCausalLM): embedding
/// gather, RMSNorm, rotate_half RoPE at explicit position ids, grouped-query
/// causal attention of each sequence over its blocks of the paged cache
/// (FlashAttention-style tensor-core kernel for prefill chunks, split-K
/// kernel for decode / verify rows), SiLU-gated MLP, final norm and lm_head
/// for the requested rows only. The projections are cuBLAS GEMMs over the
/// concatenated rows of every sequence in the batch.
///
/// Precision: weights, KV cache and GEMM inputs are the weights' dtype (bf16
/// or fp16); every GEMM accumulates in fp32 (cuBLAS, CUBLAS_COMPUTE_32F); the
/// residual stream, norms, RoPE, softmax and logits are fp32.
///
/// The KV pool is device memory: per layer K and V planes of [num_blocks *
/// block_size, kv_heads, head_dim] in the weights' dtype, allocated up
/// front. One instance owns a CUDA stream, a cuBLAS handle and a workspace
/// that grows to the largest batch seen; Forward calls are serialised (the
/// GPU runs one at a time anyway). Construct on the device that runs it.
class CudaModelRunner : public ModelRunner {
 public:
  /// Which attention kernel Forward uses. kAuto: FlashAttention (one
  /// launch per such sequence) for sequences with >= kFlashMinRows new rows
  /// when the head_dim / dtype are supported; every other sequence of the
  /// step goes into one BatchedAttention launch per layer (split-K over
  /// the paged tables, planned by PlanBatchedAttention). The others force
  /// one (tests, benchmarks): kSplitK batches every sequence; kFlash falls
  /// back to the batched launch where unsupported. kFlashMma is kAuto with
  /// FlashMmaAttention (flash_mma.h: mma.sync, FlashAttention-2 style) for
  /// the long sequences it supports (head_dim 64 / 128, no tree), the WMMA
  /// FlashAttention for the rest; the services' --prefill_attention=mma.
  /// Not the default until it is measured against kAuto on a GPU.
  /// kCudnn is kAuto with cuDNN's fused SDPA (cudnn_attention.h) for the
  /// long sequences whose shape it supports (head_dim 64 / 128, no tree):
  /// their cached K / V rows are gathered into a dense buffer, then one
  /// cuDNN call per sequence and layer; where libcudnn is missing or no
  /// cuDNN engine takes the shape, FlashAttention runs instead. The
  /// services' --prefill_attention=cudnn.
  /// Selecting kCudnn plans (and so compiles) cuDNN's kernels for a full
  /// and an appended chunk of kWarmCudnnRows rows at once, so requests do
  /// not wait for the compiler.
  enum class AttentionPath { kAuto, kFlash, kSplitK, kFlashMma, kCudnn };
  static constexpr int kWarmCudnnRows = 2048;
  static constexpr int kFlashMinRows = 32;
  /// An eager step's last layer computes only the logit rows of a chunk of
  /// kFlashMinRows rows or more whose logit rows are its last
  /// kPrunedMaxRows rows or fewer (a prefill chunk's last row, a short
  /// suffix): their attention on the split-K kernel, then o_proj and the
  /// MLP over those rows. The other rows' K / V are stored all the same;
  /// nothing reads their last-layer outputs.
  static constexpr int kPrunedMaxRows = 16;

  /// Creates the stream, the cuBLAS handle and the KV pool.
  /// INVALID_ARGUMENT for null weights or bad cache options;
  /// RESOURCE_EXHAUSTED when the pool does not fit; INTERNAL when CUDA or
  /// cuBLAS cannot start (no device included).
  static absl::StatusOr<std::unique_ptr<CudaModelRunner>> Create(
      std::shared_ptr<const CudaWeights> weights,
      const KvCacheOptions& cache_options = {});
  ~CudaModelRunner() override;
  CudaModelRunner(const CudaModelRunner&) = delete;
  CudaModelRunner& operator=(const CudaModelRunner&) = delete;

  const ModelConfig& config() const override { return weights_->config(); }
  std::string backend() const override { return "cuda"; }
  PagedKvCache& kv_cache() override { return *cache_; }
  const CudaWeights& weights() const { return *weights_; }
  /// The stream every kernel of Forward runs on.
  cudaStream_t stream() const { return stream_; }
  /// Multiprocessors of the device (sizes the split-K grid).
  int num_sms() const { return num_sms_; }
  /// Bytes one token costs across all layers (K and V) at `dtype`.
  static size_t BytesPerToken(const ModelConfig& config, CudaDType dtype);

  void set_attention_path(AttentionPath path);
  /// kCudnn: plan every chunk shape cuDNN is asked for (true), instead of
  /// the default, which runs a chunk whose shape has no plan yet on
  /// FlashMmaAttention until the plan pays off (CudnnPlanPolicy): a plan
  /// is built inside the step that needs it, ~0.04 s on an H200.
  /// Tests set it to put small chunks through cuDNN.
  void set_cudnn_plan_every_chunk(bool enabled);
  /// cuDNN plans built so far (CudnnAttention::plans_built; 0 before the
  /// kCudnn path first needs cuDNN, or where it does not load).
  int cudnn_plans_built();
  /// The path Forward uses now: set_attention_path's, or the one
  /// TunePrefillAttention kept.
  AttentionPath attention_path();

  /// Times the phases of every eager forward (PhaseTimer: embedding, the
  /// norms, each projection, RoPE + KV store, the cuDNN path's KV gather,
  /// attention, SiLU, the logits) until turned off; graph replays are not
  /// timed. For finding where a prefill's time goes (gpu_bench
  /// --phase_times); off by default, as ~12 events a layer cost launch
  /// time.
  void set_phase_timing(bool enabled);
  /// Seconds per phase of the forwards timed since the last call, in a
  /// layer's order, and how many forwards that was (*forwards); resets
  /// them. Every phase at 0 when none was timed.
  std::vector<std::pair<std::string, double>> TakePhaseTimes(
      int* forwards = nullptr);

  /// The projections of steps of at most cuda_kernels::kSkinnyMaxRows rows
  /// (decode, verify and look-ahead steps, a pruned last layer's live rows)
  /// run on cuBLAS unless TuneSkinnyLinear chose SkinnyLinear
  /// (skinny_linear.h) for them on this GPU. set_skinny_linear(true) puts
  /// every one on SkinnyLinear (tests), false every one back on cuBLAS.
  /// Both drop the captured CUDA graphs, which hold the old choice; the
  /// next graph step of each bucket captures again.
  void set_skinny_linear(bool everywhere);
  /// TuneSkinnyLinear (linear.h) over this model's weights for 1..max_rows
  /// rows, keeping its choice; every trial returned. The services run it
  /// before WarmUp (--decode_gemm=auto). Errors as TuneSkinnyLinear (the
  /// choice is then left as it was).
  absl::StatusOr<std::vector<SkinnyLinearTrial>> TuneSkinnyLinear(
      int max_rows = cuda_kernels::kSkinnyMaxRows);
  /// --decode_gemm: "cublas" (set_skinny_linear(false)), "skinny"
  /// (set_skinny_linear(true)) or "auto" (TuneSkinnyLinear over 1..8
  /// rows); returns the log line saying what was chosen
  /// (DescribeSkinnyTuning's for "auto"). INVALID_ARGUMENT for any other
  /// mode (ValidateDecodeGemm); TuneSkinnyLinear's errors, the choice then
  /// left as it was.
  absl::StatusOr<std::string> ChooseDecodeGemm(absl::string_view mode);
  /// SkinnyLinear launches enqueued so far by eager steps and graph
  /// captures (replays not counted; reset by the two calls above).
  int64_t skinny_linear_launches();

  /// CUDA graphs (on by default; the services' --cuda_graphs): a decode or
  /// verify step of greedy (argmax_only) or device-sampled
  /// (ForwardInput::sampling) sequences with at most kMaxGraphRows rows in
  /// all, every row a logit row, no tree or FlashAttention sequence, at
  /// most kGraphMaxDraftQ draft-distribution entries and
  /// kGraphMaxLogitEdits logit edits (ForwardInput::logit_edits), and
  /// queries captured only into device captures (at most
  /// kGraphMaxCaptureRows rows, in steps without sampled rows: Speculative
  /// Prefill's look-ahead steps), is
  /// padded to its bucket (1, 2, 4, 8, then multiples of 8; padding rows
  /// store no KV) and replayed from a graph captured on the bucket's first
  /// such step (one graph per bucket for greedy steps, one for steps with
  /// sampled rows, one for greedy steps that capture queries), instead of
  /// ~15 launches per layer. Inputs go to a
  /// fixed device workspace allocated on first use; if that or a capture
  /// fails, the runner logs why and stays eager. Other steps always run
  /// eagerly.
  static constexpr int kMaxGraphRows = 128;
  static constexpr int kGraphMaxDraftQ = 1 << 20;
  static constexpr int kGraphMaxLogitEdits = 1 << 16;
  static constexpr int kGraphMaxCaptureRows = 32;
  void set_cuda_graphs(bool enabled);
  /// Bytes of the graphs' fixed workspace, allocated on the first graph
  /// step: kMaxGraphRows rows of every forward region, of fp32 logits and
  /// of SampleRows scratch, the sampling jobs (kGraphMaxDraftQ q entries),
  /// kGraphMaxLogitEdits logit edits (1 MiB),
  /// block tables for sequences at max_position_embeddings, and the
  /// batched attention's capacity on a GPU of `num_sms` multiprocessors
  /// (more multiprocessors, more bytes): 160 MiB for Llama 3.1 8B in bf16
  /// on 132 multiprocessors (GraphWorkspaceTest prints it).
  static size_t GraphWorkspaceBytes(const ModelConfig& config,
                                    CudaDType dtype, int block_size,
                                    int num_sms);
  /// Whether graphs are on (false after a failed capture too).
  bool cuda_graphs();
  /// Steps run from a graph so far.
  int64_t graph_replays();
  /// Graphs captured so far (greedy, sampled and capturing, all buckets).
  int graphs_captured();

  /// Does at start-up what a server's first requests would otherwise pay
  /// for (vLLM's profile run and graph capture at start): one prefill
  /// chunk of `prefill_rows` rows (at most max_position_embeddings and
  /// half the pool), which loads the long-prefill attention path's kernels
  /// and plans and cuBLAS's for that many rows; then, with CUDA graphs on,
  /// one greedy and one sampled decode step of every bucket up to
  /// `max_batch` rows (GraphBucket: 1, 2, 4, 8, 16, ...), capturing their
  /// graphs, while the pool has a free block per row, and one greedy
  /// one-row step that captures its query (a scoring request's look-ahead
  /// step, Speculative Prefill) into a bucket-1 graph. Its sequences are
  /// freed before it returns. Errors as Forward; a failed capture only
  /// turns graphs off, as in Forward.
  absl::Status WarmUp(int prefill_rows, int max_batch = kMaxGraphRows);

  /// Chooses the long-prefill attention kernel by timing it on this GPU,
  /// as PyTorch's cudnn.benchmark does (prefill_tuning.h): the reference
  /// kAuto (WMMA FlashAttention), kFlashMma where the head_dim / dtype
  /// allow, kCudnn where libcudnn loads and an engine takes the shape. A
  /// scratch sequence is filled to `context_tokens` (clamped to the
  /// model's context and half the pool) in chunks of `chunk_rows` (at most
  /// half of that); its last chunk, the attention-heaviest of a chunked
  /// prefill, is run once untimed (kernel loading, cuDNN's plan) and
  /// `reps` times timed with each kernel, the sequence truncated back in
  /// between. Keeps ChoosePrefillTrial's pick (set_attention_path) and
  /// returns every trial; a candidate whose forward fails is recorded as
  /// not run. The sequence is freed before it returns. Errors: the
  /// reference's Forward errors; FAILED_PRECONDITION where the chunk would
  /// be under kFlashMinRows rows (the path is then left as it was).
  absl::StatusOr<PrefillTuning> TunePrefillAttention(int context_tokens,
                                                     int chunk_rows,
                                                     int reps = 2);

  absl::StatusOr<std::unique_ptr<QueryCapture>> NewQueryCapture(
      int max_rows) override;
  /// Synchronous: returns when the logits (and host queries) are on the
  /// host. Errors as ModelRunner::Forward, plus INVALID_ARGUMENT for a
  /// capture of another backend or shape.
  using ModelRunner::Forward;
  absl::Status Forward(absl::Span<const SequenceForward> batch,
                       std::vector<ForwardOutput>* out) override;
  /// The device reduction (CudaImportance) over the sequence's prompt keys,
  /// gathered from its blocks; only prompt_len floats per row come back.
  absl::StatusOr<ImportanceResult> ScoreImportance(
      const KvSequence& kv, int prompt_len, const QueryCapture& capture,
      const ScoringOptions& options, int num_threads) override;

  /// Device pointer to layer `layer`'s key (value) plane: T [num_blocks *
  /// block_size, kv_heads * head_dim].
  void* keys(int layer) const;
  void* values(int layer) const;
  /// Copies `kv`'s first `count` keys (values) of `layer` to the host as
  /// fp32 [count, kv_heads * head_dim] (tests; synchronous).
  absl::StatusOr<std::vector<float>> CopyKeysToHost(int layer,
                                                    const KvSequence& kv,
                                                    int count) const;

 private:
  CudaModelRunner(std::shared_ptr<const CudaWeights> weights,
                  cudaStream_t stream, cublasHandle_t cublas, int num_sms);
  struct StepLaunch;
  struct GraphLayout;
  absl::Status CopyBlock(int src, int dst);
  // Where each captured row of a step goes (CaptureQueryRows), in batch
  // order: into its sequence's CudaQueryCapture after the rows it holds,
  // or, for a sequence without one, into `host` (fp32 [L, host_rows, H *
  // D]: the step's rows captured for the host, in batch order).
  std::vector<cuda_kernels::CaptureSlot> CaptureSlots(
      absl::Span<const SequenceForward> batch, float* host, int host_rows);
  absl::Status Run(absl::Span<const SequenceForward> batch,
                   const std::vector<std::vector<int>>& logit_rows,
                   const std::vector<int>& first,
                   std::vector<ForwardOutput>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The kernels of one step, embedding to logits (and argmax), on stream_.
  absl::Status EnqueueForward(const StepLaunch& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the step from a CUDA graph: false (nothing run) when the step does
  // not qualify or graphs are off.
  absl::StatusOr<bool> RunGraphed(
      absl::Span<const SequenceForward> batch,
      const std::vector<std::vector<int>>& logit_rows,
      const std::vector<int>& first, std::vector<ForwardOutput>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AllocateGraphLayout() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Destroys every captured graph (after the stream is idle).
  void DropGraphs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ForwardInput::logprobs_top_n: after the step's argmax / SampleRows
  // results reached the host, the logprobs of each such sequence's row
  // tokens from the logits still on the device (RowLogprobs), indexed by
  // logit row (lr0: per-sequence logit row starts; samp_out: SampleRows'
  // [2, num_sampled] ids and flags). Synchronises the stream; leaves
  // *row_logprobs empty (and does nothing) when no sequence asked.
  absl::Status RowLogprobsOnDevice(absl::Span<const SequenceForward> batch,
                                   const std::vector<int>& lr0,
                                   const std::vector<int>& argmax,
                                   const std::vector<int>& samp_out,
                                   int num_sampled, const float* d_logits,
                                   std::vector<TokenLogprobs>* row_logprobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether cuDNN's SDPA takes `shape` (creates the handle and builds the
  // plan on first use); false, after one log line, where it cannot.
  bool CudnnSupports(const CudnnSdpaShape& shape)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::shared_ptr<const CudaWeights> weights_;
  cudaStream_t stream_;
  cublasHandle_t cublas_;
  int num_sms_;
  int row_width_ = 0;
  std::unique_ptr<PagedKvCache> cache_;
  DeviceBuffer pool_;  // [layers][K, V][num_blocks * block_size][row_width]
  absl::Mutex mu_;
  AttentionPath attention_path_ ABSL_GUARDED_BY(mu_) = AttentionPath::kAuto;
  // kCudnn: the handle and plans, created on first use (null after a failed
  // creation, which is logged once), and the dense K / V rows it reads.
  std::unique_ptr<CudnnAttention> cudnn_ ABSL_GUARDED_BY(mu_);
  bool cudnn_unavailable_ ABSL_GUARDED_BY(mu_) = false;
  bool cudnn_plan_every_chunk_ ABSL_GUARDED_BY(mu_) = false;
  CudnnPlanPolicy cudnn_plan_policy_ ABSL_GUARDED_BY(mu_);
  bool phase_timing_ ABSL_GUARDED_BY(mu_) = false;
  PhaseTimer phase_timer_ ABSL_GUARDED_BY(mu_);  // events made on first use
  DeviceBuffer cudnn_kv_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer logprobs_ws_ ABSL_GUARDED_BY(mu_);  // RowLogprobsOnDevice
  DeviceBuffer workspace_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer cublas_workspace_;
  bool cuda_graphs_ ABSL_GUARDED_BY(mu_) = true;
  LinearDispatch linear_ ABSL_GUARDED_BY(mu_);  // cuBLAS or SkinnyLinear
  int64_t graph_replays_ ABSL_GUARDED_BY(mu_) = 0;
  // Graph steps' fixed workspace, its layout, and one executable graph per
  // bucket (indexed by the bucket's rows).
  DeviceBuffer graph_workspace_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<GraphLayout> graph_layout_ ABSL_GUARDED_BY(mu_);
  // The graphs' edit offsets hold a step's edits (not all zeros).
  bool graph_edits_live_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<cudaGraphExec_t> graphs_ ABSL_GUARDED_BY(mu_) =
      std::vector<cudaGraphExec_t>(kMaxGraphRows + 1, nullptr);
  std::vector<cudaGraphExec_t> sampled_graphs_ ABSL_GUARDED_BY(mu_) =
      std::vector<cudaGraphExec_t>(kMaxGraphRows + 1, nullptr);
  std::vector<cudaGraphExec_t> capture_graphs_ ABSL_GUARDED_BY(mu_) =
      std::vector<cudaGraphExec_t>(kMaxGraphRows + 1, nullptr);
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDA_MODEL_RUNNER_H_
