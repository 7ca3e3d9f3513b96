#ifndef SPECSERVE_COMMON_CUDA_KERNELS_H_
#define SPECSERVE_COMMON_CUDA_KERNELS_H_

// Device kernels of the CUDA Llama forward and of Speculative Prefill's
// token-importance reduction, as host-callable launchers. The kernels are in
// kernels.cu (element-wise and row-wise ops), attention.cu (prefill and
// decode/verify attention) and importance.cu (scoring); this header is plain
// C++ so host code compiled by g++ can call them.
//
// Conventions: every pointer argument is DEVICE memory unless named host_*;
// matrices are row-major; "T" is the element type named by a CudaDType
// argument. Every launcher enqueues on `stream`, does not synchronise, and
// returns cudaGetLastError() after its launches (cudaSuccess, or the launch
// error; a kernel's runtime fault surfaces at the next synchronising call).
// Shapes that cannot be launched return cudaErrorInvalidValue.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace specserve {

/// Element type of a device tensor. Weights and the KV cache are kBF16
/// (default) or kFP16; kF32 is accepted where a launcher says so (the fp32
/// residual stream, tests that check fp32 math to 1e-5).
enum class CudaDType { kF32, kBF16, kFP16 };

/// Bytes per element: 4, 2, 2.
size_t CudaDTypeBytes(CudaDType dtype);
/// "f32", "bf16", "fp16".
const char* CudaDTypeName(CudaDType dtype);

namespace cuda_kernels {

/// dst[i] = T(src[i]) for i < n, round-to-nearest-even. `dst_dtype` any.
cudaError_t ConvertFromF32(const float* src, void* dst, CudaDType dst_dtype,
                           size_t n, cudaStream_t stream);

/// dst[i] = float(src[i]) for i < n (exact). `src_dtype` any.
cudaError_t ConvertToF32(const void* src, CudaDType src_dtype, float* dst,
                         size_t n, cudaStream_t stream);

/// Embedding lookup: out[i, :] = float(table[ids[i], :]).
/// table: T [vocab, hidden]; ids: int [n], each in [0, vocab) (the caller
/// validates on the host); out: fp32 [n, hidden].
cudaError_t EmbeddingGather(const void* table, CudaDType dtype, const int* ids,
                            int n, int hidden, float* out, cudaStream_t stream);

/// RMSNorm (HF LlamaRMSNorm): out[r, :] = x[src, :] * w / sqrt(mean(x[src,
/// :]^2) + eps), in fp32, stored as `out_dtype`, with src = rows[r] when
/// `rows` is non-null (gathers e.g. the logit rows) else r.
/// x: fp32 [*, dim]; rows: int [num_rows] or null; w: fp32 [dim];
/// out: out_dtype [num_rows, dim].
cudaError_t RmsNorm(const float* x, const int* rows, int num_rows, int dim,
                    const float* w, float eps, void* out, CudaDType out_dtype,
                    cudaStream_t stream);

/// Arguments of RopeQkvStore.
struct RopeArgs {
  /// fp32 [n, (H + 2*KV) * head_dim]: the fused projection's q, k, v heads.
  /// With rotate_in_place the q and k heads are rotated in place (the
  /// capture of post-RoPE queries reads them from here); else only read.
  float* qkv = nullptr;
  /// Write the rotated q and k heads back into qkv. Off, a prefill row
  /// moves (H + KV) * head_dim * 4 fewer bytes (20 KB a row on Llama 3
  /// 8B: 0.67 GB a layer at 32K rows).
  bool rotate_in_place = true;
  int n = 0;
  int num_heads = 0;     ///< H
  int num_kv_heads = 0;  ///< KV
  int head_dim = 0;      ///< even
  /// int [n] RoPE position of each row.
  const int* positions = nullptr;
  double theta = 10000.0;
  /// double [head_dim / 2] inverse frequencies (ComputeRopeFrequencies:
  /// rope_scaling applied), or null for theta^(-2i / head_dim).
  const double* inv_freq = nullptr;
  /// cos and sin are multiplied by this (YaRN's mscale; 1 = plain RoPE).
  double attention_factor = 1.0;
  /// T [n, H * head_dim] rotated queries, or null to skip.
  void* q_out = nullptr;
  /// T [capacity, KV * head_dim] cache planes of one layer: rotated keys and
  /// the values of row i land in slot cache_first + i. Null to skip.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int cache_first = 0;
  /// int [n] physical cache row of each row (a paged cache), or null for
  /// rows cache_first + i. A negative slot stores nothing (a CUDA graph's
  /// padding rows).
  const int* slots = nullptr;
  /// T of q_out, k_cache and v_cache (any CudaDType).
  CudaDType dtype = CudaDType::kBF16;
};

/// Rotary embedding (HF rotate_half: dimension i pairs with i + head_dim/2,
/// angle = pos * inv_freq[i] (default theta^(-2i/head_dim)), angles and
/// their cos/sin in double, times attention_factor, as the CPU
/// kernels::ApplyRope) on the q and k heads of `args.qkv`, then stores q, k
/// and v as T (see RopeArgs).
cudaError_t RopeQkvStore(const RopeArgs& args, cudaStream_t stream);

/// x[r, c] += bias[c] for r < rows, c < cols, fp32. x: [rows, stride]
/// (stride >= cols); bias: fp32 [cols]. Qwen2's q/k/v biases on the fused
/// projection output, an o_proj bias on the residual stream.
cudaError_t AddBias(float* x, size_t stride, int rows, int cols,
                    const float* bias, cudaStream_t stream);

/// out[r] = the id of row r's largest logit, specserve::Argmax's rule: ties
/// go to the lowest id, NaN never wins (an all-NaN row gives 0). One block
/// per row. logits: fp32 [rows, vocab]; out: int [rows]. Greedy decoding
/// and verification read these instead of copying the logits to the host.
cudaError_t ArgmaxRows(const float* logits, int rows, int vocab, int* out,
                       cudaStream_t stream);

/// Qwen3's q_norm / k_norm, in place: in each of the `n` rows of `qkv`
/// (fp32 [n, (H + 2*KV) * head_dim], q heads then k heads then v heads),
/// every q head becomes RMSNorm(head) * q_weight and every k head
/// RMSNorm(head) * k_weight (fp32 math as RmsNorm; v untouched).
/// q_weight, k_weight: fp32 [head_dim].
cudaError_t HeadRmsNorm(float* qkv, int n, int num_heads, int num_kv_heads,
                        int head_dim, const float* q_weight,
                        const float* k_weight, float eps,
                        cudaStream_t stream);

/// SwiGLU: out[r, i] = silu(gu[r, i]) * gu[r, ffn + i] in fp32.
/// gu: T [rows, 2 * ffn] (gate columns, then up columns); out: T [rows, ffn].
cudaError_t SiluMul(const void* gu, int rows, int ffn, void* out,
                    CudaDType dtype, cudaStream_t stream);

/// Arguments of the attention launchers: grouped-query causal attention of
/// n new tokens of one sequence over the KV cache, which already holds them
/// (slots [first, first + n)) after `first` earlier tokens. Row i (slot
/// first + i) attends to slots [0, first + i]: causal over the cache ORDER,
/// whatever the tokens' RoPE positions (Speculative Prefill caches kept
/// tokens at non-contiguous positions).
struct AttentionArgs {
  /// T [n, H, head_dim] post-RoPE queries.
  const void* q = nullptr;
  /// T [>= first + n, KV, head_dim] post-RoPE keys / values of one layer.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  /// T [n, H * head_dim] attention output (heads concatenated).
  void* out = nullptr;
  CudaDType dtype = CudaDType::kBF16;
  int n = 0;
  int first = 0;
  int num_heads = 0;     ///< H, a multiple of KV (query head h reads h / (H/KV))
  int num_kv_heads = 0;  ///< KV
  int head_dim = 0;
  /// Softmax scale, normally 1 / sqrt(head_dim).
  float scale = 1.0f;
  /// Paged cache (PagedAttention): int [>= ceil((first + n) / block_size)]
  /// physical block ids; logical slot t lives at row block_table[t /
  /// block_size] * block_size + t % block_size of k_cache / v_cache. Null =
  /// contiguous (slot t at row t).
  const int* block_table = nullptr;
  int block_size = 1;
  /// Tree attention (ForwardInput::tree_parents), null = causal: for each
  /// of the n rows, the cache index its tree span starts at (INT_MAX for a
  /// row outside the span) and a bit mask over the span's first 64
  /// entries: key slot tree_start[i] + j is visible to row i iff bit j is
  /// set. Keys before the span, and causal limits, are as without a tree.
  const int* tree_start = nullptr;
  const unsigned long long* tree_mask = nullptr;
};

/// Whether FlashAttention handles `head_dim` and `dtype`: head_dim in
/// {16, 32, 64, 128} and dtype kBF16 or kFP16.
bool FlashAttentionSupported(int head_dim, CudaDType dtype);

/// Prefill attention, FlashAttention-2 style (Dao 2023): one block per 64
/// query rows of one head, streaming 64-key tiles of K and V through shared
/// memory, Q.K^T and P.V on the tensor cores (WMMA, bf16/fp16 operands,
/// fp32 accumulation), online softmax in fp32. For long new-token batches.
/// cudaErrorInvalidValue unless FlashAttentionSupported.
cudaError_t FlashAttention(const AttentionArgs& args, cudaStream_t stream);

/// Number of key splits SplitKAttention should use so that about two blocks
/// per SM are busy (`num_sms` multiprocessors): 1 for long batches, up to 64
/// for one decode row over a long cache, at least 64 keys per split. Reads
/// only the shape fields of `args` (pointers may be null); 1 for an invalid
/// shape. Host-only, no CUDA call.
int SplitKAttentionSplits(const AttentionArgs& args, int num_sms);

/// Device scratch bytes SplitKAttention needs for `num_splits`: partial
/// outputs fp32 [splits, n, H, head_dim] plus max / sum fp32 [splits, n, H].
size_t SplitKAttentionWorkspaceBytes(const AttentionArgs& args,
                                     int num_splits);

/// Decode / verify attention, flash-decoding style: the keys are split into
/// `num_splits` ranges; each block scores up to 16 (row, query head) pairs
/// of one kv head against one range in fp32 (any head_dim <= 256, dtype any
/// CudaDType), then a second kernel merges the ranges' partial softmaxes.
/// `workspace`: SplitKAttentionWorkspaceBytes(args, num_splits) bytes.
/// cudaErrorInvalidValue for a bad shape, a null workspace or num_splits
/// outside [1, 64] (kBatchedAttentionMaxSplits: a merge thread per split).
cudaError_t SplitKAttention(const AttentionArgs& args, int num_splits,
                            void* workspace, cudaStream_t stream);

/// Arguments of BatchedAttention: the attention of every sequence of a step
/// (decode rows, verify rows, prefill chunks) in one launch over the paged
/// cache, as planned by PlanBatchedAttention (attention_plan.h), whose int
/// arrays the plan fields point to (uploaded to the device).
struct BatchedAttentionArgs {
  /// T [total_rows, H, head_dim] post-RoPE queries, sequences concatenated.
  const void* q = nullptr;
  /// T [pool rows, KV, head_dim] post-RoPE keys / values of one layer.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  /// T [total_rows, H * head_dim] attention output.
  void* out = nullptr;
  CudaDType dtype = CudaDType::kBF16;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 1.0f;
  /// Concatenated block tables (sequence i's at seq_info's table start):
  /// logical slot t at row table[t / block_size] * block_size + t %
  /// block_size of k_cache / v_cache.
  const int* block_tables = nullptr;
  int block_size = 1;
  /// BatchedAttentionPlan::seq_info, work, combine (device copies).
  const int* seq_info = nullptr;
  const int* work = nullptr;
  int num_work = 0;
  const int* combine = nullptr;
  int num_combine = 0;
  /// BatchedAttentionWorkspaceBytes(plan, head_dim) bytes (null when 0).
  void* workspace = nullptr;
  int64_t partial_triples = 0;
  /// For a launch captured in a CUDA graph: int [2] on the device, the
  /// step's real work and combine counts, read at run time. num_work,
  /// num_combine and partial_triples are then capacities
  /// (BatchedAttentionCapacityFor) that size the grids and the workspace's
  /// layout; blocks past the real counts return at once. Null = the
  /// counts are num_work / num_combine.
  const int* device_counts = nullptr;
  /// Tree attention as in AttentionArgs, indexed by the global row
  /// (sequences concatenated); null = causal everywhere.
  const int* tree_start = nullptr;
  const unsigned long long* tree_mask = nullptr;
};

/// One launch for all the sequences of a step (flash-decoding over a work
/// list): block (w, g) scores up to 16 (row, query head) pairs of kv head g
/// of work item w's sequence against its key split in fp32, as
/// SplitKAttention does for one sequence (any head_dim <= 256, any dtype);
/// sequences with one split write `out` directly, the rows of split
/// sequences are merged by a second launch. Nothing is launched for an
/// empty plan. cudaErrorInvalidValue for a bad shape or a missing pointer.
cudaError_t BatchedAttention(const BatchedAttentionArgs& args,
                             cudaStream_t stream);

/// Gathers `count` logical slots of one sequence from a paged K or V plane
/// into dense rows: dst[t, :] = pool[block_table[t / block_size] *
/// block_size + t % block_size, :] for t < count. pool / dst: T [*,
/// row_width]; block_table: int device array.
/// Rows of 16-byte multiples at 16-byte aligned addresses move in 16-byte
/// words.
cudaError_t GatherKvRows(const void* pool, CudaDType dtype,
                         const int* block_table, int block_size, int count,
                         int row_width, void* dst, cudaStream_t stream);

/// dst[j, :] = src[rows[j], :] for j < n: `row_width` elements of `dtype`
/// a row (fp32 included), rows an int device array. Moves 16-byte words
/// where rows and pointers allow, as GatherKvRows. cudaErrorInvalidValue
/// for a null pointer or n, row_width < 1.
cudaError_t GatherRows(const void* src, CudaDType dtype, const int* rows,
                       int n, int row_width, void* dst, cudaStream_t stream);

/// Where one captured query row goes (CaptureQueryRows): layer l's copy of
/// step row `row` lands at dst + l * layer_stride floats. row < 0: an unused
/// slot (a graph's padding), nothing copied.
struct CaptureSlot {
  float* dst = nullptr;
  long long layer_stride = 0;
  int row = -1;
  int pad = 0;
};

/// For each of `num_slots` slots (a device array) with row >= 0:
/// slots[k].dst[layer * layer_stride + i] = qkv[row * qkv_dim + i] for
/// i < qrow, the fp32 post-RoPE query heads of one row of a step into a
/// query capture (Speculative Prefill's look-ahead rows). One launch a
/// layer whatever the rows, so a CUDA graph can capture it (its slots are
/// read at replay). cudaErrorInvalidValue for a null pointer, num_slots
/// < 1 or qrow > qkv_dim.
cudaError_t CaptureQueryRows(const float* qkv, int qkv_dim, int qrow,
                             const CaptureSlot* slots, int num_slots,
                             int layer, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Speculative Prefill token importance (arXiv 2502.02789 section 3.2; docs
// docs/ARCHITECTURE.md, Speculative Prefill steps 3-5), the device side of CudaImportance. The
// CPU reference is specserve::ImportanceAccumulator.
// ---------------------------------------------------------------------------

/// logits[h, r, j] = (q[r, h, :] * scale) . keys[j, h / (H/KV), :] in fp32
/// (q pre-scaled, then one fma chain over d in order, as the CPU reference).
/// q: fp32 [rows, H, head_dim]; keys: T (key_dtype) with prompt token j's
/// [KV, head_dim] at keys + j * key_row_stride ELEMENTS; logits: fp32
/// [H, rows, prompt_len].
cudaError_t ImportanceLogits(const float* q, const void* keys,
                             CudaDType key_dtype, size_t key_row_stride,
                             int prompt_len, int rows, int num_heads,
                             int num_kv_heads, int head_dim, float scale,
                             float* logits, cudaStream_t stream);

/// In place, for each of `num_rows` rows of `len` floats: softmax
/// (max-subtracted, sum accumulated in double) -> probabilities.
cudaError_t ImportanceSoftmax(float* logits, int num_rows, int len,
                              cudaStream_t stream);

/// For each scoring row r and prompt token j: pooled_h = avg_pool1d(probs[h,
/// r, :], kernel, stride 1, padding kernel/2, count_include_pad)[j]; then
/// the max (is_max) or sum over heads h, folded into running[r, j] by max
/// (is_max) or +=. probs: fp32 [H, rows, len]; running: fp32 [rows, len]
/// (start it at 0: probabilities are >= 0, so max with 0 is the identity).
cudaError_t ImportancePoolFold(const float* probs, int rows, int num_heads,
                               int len, int kernel, bool is_max,
                               float* running, cudaStream_t stream);

/// out[j] = mean over r of float(running[r, j] * scale) (sum in double).
/// running: fp32 [rows, len]; out: fp32 [len].
cudaError_t ImportanceMeanRows(const float* running, int rows, int len,
                               float scale, float* out, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_KERNELS_H_
