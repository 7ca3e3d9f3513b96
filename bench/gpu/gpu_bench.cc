// CUDA backend benchmark: Speculative Prefill with a llama-3.2-1b-shaped
// speculator and a llama-3.1-8b-shaped target on one GPU.
//
//   tools/gpu/run_gpu_bench.sh            (on the GPU machine; see there)
//   .device/gpu/gpu_bench --speculator DIR --target DIR [--json_out F]
//
// Everything is measured in the same run, on the same device:
//  * ceilings: cuBLAS bf16 GEMM peak (8192^3 unless --peak_gemm_size, fp32
//    accumulation) and the device-to-device copy bandwidth (bytes read +
//    written, 4 GiB unless --copy_bytes);
//  * GEMM MFU: the target's per-layer projections through cuBLAS at M =
//    prompt length on random activations, as a fraction of that peak, with
//    the output type and beta the forward uses and with a 16-bit output;
//  * the services' start-up choice of prefill attention for each model
//    (TunePrefillAttention, --prefill_attention=auto), logged as
//    "<model> start-up tuning: ..." and in the JSON; and of the few-row
//    projections' kernel (TuneSkinnyLinear, --decode_gemm=auto: cuBLAS or
//    SkinnyLinear, per projection and row count), logged as "<model>
//    decode GEMM tuning: ..." with both kernels' times at one row;
//  * per prompt length (4K..32K): target prefill of the full prompt with
//    each prefill attention path (WMMA, mma.sync, cuDNN where libcudnn
//    loads), then, with the path the services' start-up rule keeps
//    (ChoosePrefillTrial: the fastest whose last-row top-1 agrees with the
//    default's up to a near tie, cuDNN within 5% of it), the prefill of
//    the kept 10% / 30% (at their original positions), the speculator's
//    scoring time (prefill with query capture, look-ahead decode, device
//    reduction, selection), TTFT speedup = that path's full prefill /
//    (scoring + kept prefill);
//  * decode tokens/s of both models after each prefill, with the fraction
//    of the copy bandwidth that reading weights + KV implies;
//  * the speculator's scoring prefill and the target's kept prefill in
//    chunks of --service_chunk rows, as the services' schedulers run them
//    (--max_num_batched_tokens), against one pass;
//  * with --phase_times (the default), where each prefill's time goes:
//    one more run of each with the runner's phase timer on
//    (CudaModelRunner::set_phase_timing: projections, attention, the KV
//    gather, element-wise kernels), printed as "phases of ..." lines and
//    in the JSON;
//  * verify-round time of the target vs the number of drafts k;
//  * batched decode of the target: B sequences of --decode_context tokens
//    each decoding one token per step together (greedy on the device, from
//    CUDA graphs and eagerly), tokens/s and the fraction of the copy
//    bandwidth that reading weights + B sequences' KV implies: the engine
//    side of run_stack_bench.sh's concurrent-streams table, without the
//    services, the scheduler or HTTP.
// Timings are wall clock around synchronous calls (what a request waits),
// median of --reps runs after a warm-up.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/cuda/cuda_model_runner.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/device.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/cuda/linear.h"
#include "common/cuda/prefill_tuning.h"
#include "common/decoding/sampling.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner.h"
#include "common/engine/paged_kv_cache.h"
#include "common/model/weights.h"
#include "common/specprefill/importance.h"
#include "common/specprefill/selection.h"

ABSL_FLAG(std::string, speculator, "",
          "speculator checkpoint dir (llama-3.2-1b shape)");
ABSL_FLAG(std::string, target, "", "target checkpoint dir (llama-3.1-8b shape)");
ABSL_FLAG(std::string, prompt_lens, "4096,8192,16384,32768",
          "comma-separated prompt lengths (tokens)");
ABSL_FLAG(std::string, keep, "0.1,0.3", "comma-separated keep ratios");
ABSL_FLAG(int, lookahead, 8, "speculator look-ahead decode steps");
ABSL_FLAG(int, chunk_size, 32, "selection chunk size");
ABSL_FLAG(int, decode_tokens, 32, "decode steps timed per prompt length");
ABSL_FLAG(std::string, verify_ks, "1,2,4,8,16",
          "draft counts k for the verify-round timing (k + 1 rows)");
ABSL_FLAG(std::string, decode_batches, "1,16,64,128",
          "comma-separated sequence counts B of the batched decode stage "
          "(one token per sequence per step; empty skips the stage)");
ABSL_FLAG(int, decode_context, 256,
          "prompt tokens of each sequence of the batched decode stage");
ABSL_FLAG(int, reps, 3, "timed repetitions of each prefill (median)");
ABSL_FLAG(int, service_chunk, 8192,
          "rows per chunk of the chunked prefills (the CUDA services' "
          "default --max_num_batched_tokens on GPUs of 70 GiB or more, "
          "H100 and H200)");
ABSL_FLAG(int, alt_service_chunk, 2048,
          "also time the speculator's chunked prefill at this chunk size "
          "(a --max_num_batched_tokens to try; 0 skips)");
ABSL_FLAG(bool, phase_times, true,
          "time each prefill's phases once more with the runner's phase "
          "timer (untimed otherwise)");
ABSL_FLAG(std::string, dtype, "bf16", "weights / KV dtype: bf16 | fp16");
ABSL_FLAG(std::string, json_out, "", "write the results as JSON here");
ABSL_FLAG(uint64_t, seed, 0, "prompt token seed");
ABSL_FLAG(std::string, decode_gemm, "auto",
          "projections of steps of at most 8 rows, as the services' flag: "
          "auto (timed per projection and row count, TuneSkinnyLinear), "
          "cublas or skinny");
ABSL_FLAG(int, peak_gemm_size, 8192,
          "m = n = k of the cuBLAS GEMM that measures the peak");
ABSL_FLAG(int64_t, copy_bytes, int64_t{4} << 30,
          "bytes of the device-to-device copy that measures bandwidth");

namespace specserve {
namespace {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

std::vector<float> ParseFloats(const std::string& s) {
  std::vector<float> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    float v;
    if (absl::SimpleAtof(p, &v)) out.push_back(v);
  }
  return out;
}

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "error: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

// Minimal JSON object writer (flat keys, numbers and strings, nested
// arrays of objects), enough for the results file.
class Json {
 public:
  void Num(const std::string& k, double v) {
    Sep();
    absl::StrAppendFormat(&s_, "\"%s\": %.6g", k, v);
  }
  void Str(const std::string& k, const std::string& v) {
    Sep();
    absl::StrAppendFormat(&s_, "\"%s\": \"%s\"", k, v);
  }
  void Raw(const std::string& k, const std::string& v) {
    Sep();
    absl::StrAppendFormat(&s_, "\"%s\": %s", k, v);
  }
  std::string Done() const { return "{" + s_ + "}"; }

 private:
  void Sep() {
    if (!s_.empty()) s_ += ", ";
  }
  std::string s_;
};

// --- ceilings -------------------------------------------------------------

// cuBLAS bf16 GEMM (fp32 accumulation, bf16 output) TFLOP/s on random
// operands: best of 5 after 2 warm-ups, m = n = k = `size`.
double CublasPeakTflops(cublasHandle_t h, CudaDType dt, int size) {
  const size_t elems = static_cast<size_t>(size) * size;
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(elems * 2);
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(elems * 2);
  absl::StatusOr<DeviceBuffer> c = DeviceBuffer::Allocate(elems * 2);
  Die(a.status(), "alloc");
  Die(b.status(), "alloc");
  Die(c.status(), "alloc");
  Die(FillNormal(a->get(), dt, elems, 1, nullptr), "fill");
  Die(FillNormal(b->get(), dt, elems, 2, nullptr), "fill");
  double best = 1e30;
  for (int r = 0; r < 7; ++r) {
    const double t0 = Now();
    Die(CublasLinear(h, dt, a->get(), size, size, b->get(), size, c->get(), dt,
                     0.0f),
        "peak gemm");
    cudaDeviceSynchronize();
    if (r >= 2) best = std::min(best, Now() - t0);
  }
  return 2.0 * size * size * static_cast<double>(size) / best / 1e12;
}

// Device-to-device copy bandwidth in GB/s counting bytes read + written.
double CopyBandwidthGBps(size_t bytes) {
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(bytes);
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(bytes);
  Die(a.status(), "alloc");
  Die(b.status(), "alloc");
  cudaMemset(a->get(), 1, bytes);
  double best = 1e30;
  for (int r = 0; r < 6; ++r) {
    cudaDeviceSynchronize();
    const double t0 = Now();
    cudaMemcpy(b->get(), a->get(), bytes, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    if (r >= 1) best = std::min(best, Now() - t0);
  }
  return 2.0 * bytes / best / 1e9;
}

double NominalBandwidthGBps() {
  int dev = 0, clock_khz = 0, bus_bits = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth,
                             dev) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // DDR
}

// --- model helpers --------------------------------------------------------

struct Model {
  std::string name;
  ModelConfig config;
  std::shared_ptr<const CudaWeights> weights;
  std::unique_ptr<CudaModelRunner> engine;
  double load_seconds = 0;
};

// Loads `dir` onto the device with a runner whose paged KV pool holds one
// sequence of `kv_tokens` tokens (the benchmark's long prompts run one
// sequence per model at a time) plus `extra_blocks` blocks (the batched
// decode stage's sequences).
Model LoadModel(const std::string& dir, CudaDType dt, int kv_tokens,
                int extra_blocks = 0) {
  Model m;
  m.name = dir;
  const double t0 = Now();
  // As the services load: from the file to the device, no host fp32 copy.
  absl::StatusOr<std::shared_ptr<const CudaWeights>> w =
      CudaWeights::Load(dir, dt);
  Die(w.status(), dir.c_str());
  m.weights = *w;
  m.config = m.weights->config();
  KvCacheOptions kv;
  kv.pool_bytes = CudaModelRunner::BytesPerToken(m.config, dt) *
                  static_cast<size_t>(kv.block_size) *
                  (PagedKvCache::BlocksForTokens(kv_tokens, kv.block_size) +
                   static_cast<size_t>(extra_blocks));
  absl::StatusOr<std::unique_ptr<CudaModelRunner>> e =
      CudaModelRunner::Create(m.weights, kv);
  Die(e.status(), "engine");
  m.engine = *std::move(e);
  m.load_seconds = Now() - t0;
  return m;
}

// Linear FLOPs per token (q/k/v/o + MLP) over all layers.
double LayerFlopsPerToken(const ModelConfig& c) {
  const double h = c.hidden_size;
  return 2.0 * c.num_hidden_layers *
         (h * c.qkv_dim() + double(c.num_attention_heads) * c.head_dim * h +
          3.0 * h * c.intermediate_size);
}

// Causal attention FLOPs of a prefill of n tokens.
double AttentionFlops(const ModelConfig& c, double n) {
  return 2.0 * n * n * c.num_attention_heads * c.head_dim *
         c.num_hidden_layers;
}

// Bytes one decode step reads: every projection weight, the lm_head, one
// embedding row per sequence, and the K/V of `context` cached tokens of
// each of `sequences` sequences.
double DecodeBytes(const Model& m, int context, CudaDType dt,
                   int sequences = 1) {
  const ModelConfig& c = m.config;
  const double tb = CudaDTypeBytes(dt);
  const double layer_params =
      LayerFlopsPerToken(c) / 2.0;  // params of the projections
  const double lm_head = double(c.vocab_size) * c.hidden_size;
  const double kv = 2.0 * c.num_hidden_layers * double(context) *
                    c.num_key_value_heads * c.head_dim;
  return tb * (layer_params + lm_head + sequences * (kv + c.hidden_size));
}

std::unique_ptr<KvSequence> NewCache(const Model& m, int capacity) {
  absl::StatusOr<std::unique_ptr<KvSequence>> c =
      m.engine->NewSequence(capacity);
  Die(c.status(), "kv cache");
  return *std::move(c);
}

// One prefill of `ids` at `pos` into a cleared cache; seconds.
double TimePrefill(const Model& m, KvSequence* cache,
                   const std::vector<int>& ids, const std::vector<int>& pos,
                   std::vector<float>* last_logits = nullptr) {
  cache->Clear();
  ForwardInput in;
  in.token_ids = ids;
  in.position_ids = pos;
  ForwardOutput out;
  const double t0 = Now();
  Die(m.engine->Forward(in, cache, &out), "prefill");
  const double t = Now() - t0;
  if (last_logits != nullptr) *last_logits = out.logits;
  return t;
}

// The median of `reps` runs of `run`, each returning its seconds.
double MedianOfRuns(int reps, const std::function<double()>& run) {
  std::vector<double> ts;
  for (int r = 0; r < reps; ++r) ts.push_back(run());
  return MedianSeconds(ts);
}

// A prefill as the services' schedulers run a long prompt: chunks of
// `chunk` rows, each a forward reducing its last row to its argmax on the
// device; with `capture`, the last row's query captured (the speculator's
// scoring prefill). Seconds.
double TimeChunkedPrefill(const Model& m, KvSequence* cache,
                          QueryCapture* capture, const std::vector<int>& ids,
                          const std::vector<int>& pos, int chunk) {
  cache->Clear();
  if (capture != nullptr) capture->Clear();
  const int n = static_cast<int>(ids.size());
  std::vector<ForwardOutput> out;
  const double t0 = Now();
  for (int at = 0; at < n; at += chunk) {
    const int rows = std::min(chunk, n - at);
    SequenceForward f;
    f.kv = cache;
    f.input.token_ids = absl::MakeConstSpan(ids.data() + at, rows);
    f.input.position_ids = absl::MakeConstSpan(pos.data() + at, rows);
    f.input.argmax_only = true;
    if (capture != nullptr && at + rows == n) {
      f.capture = capture;
      f.input.capture_query_rows = {rows - 1};
    }
    Die(m.engine->Forward(absl::MakeConstSpan(&f, 1), &out),
        "chunked prefill");
  }
  return Now() - t0;
}

// Runs `run` once with `m`'s phase timer on and prints where its forwards'
// time went ("phases of <what> at <P>: ..."); returns the same as a JSON
// object (seconds per phase, forwards, wall and timed seconds).
std::string PhaseTimes(const Model& m, const std::string& what, int P,
                       const std::function<void()>& run) {
  m.engine->TakePhaseTimes();  // nothing timed before counts
  m.engine->set_phase_timing(true);
  const double t0 = Now();
  run();
  const double wall = Now() - t0;
  m.engine->set_phase_timing(false);
  int forwards = 0;
  const std::vector<std::pair<std::string, double>> times =
      m.engine->TakePhaseTimes(&forwards);
  double timed = 0.0;
  for (const auto& t : times) timed += t.second;
  std::string line =
      absl::StrFormat("phases of %s at %d (%d forwards, %.4f s wall, %.4f s "
                      "timed):",
                      what, P, forwards, wall, timed);
  Json j;
  for (const auto& [name, s] : times) {
    absl::StrAppendFormat(&line, " %s %.4f s (%.1f%%)", name, s,
                          timed > 0 ? 100.0 * s / timed : 0.0);
    j.Num(name, s);
  }
  j.Num("forwards", forwards);
  j.Num("wall_s", wall);
  j.Num("timed_s", timed);
  std::printf("%s\n", line.c_str());
  return j.Done();
}

// Greedy decode steps of `seqs` together, as the services run them (one
// token each per step, argmax on the device), from CUDA graphs or eagerly:
// one untimed step first (it captures the bucket's graph), then `steps`
// timed ones; seconds per step. `next` [seqs.size()]: each sequence's next
// input token, updated to the last step's output. Graphs are on again
// afterwards (the runner's default).
double TimeDecodeSteps(const Model& m, absl::Span<KvSequence* const> seqs,
                       std::vector<int>* next, int steps, bool graphs) {
  m.engine->set_cuda_graphs(graphs);
  const size_t n = seqs.size();
  std::vector<int> pos(n);
  std::vector<SequenceForward> step(n);
  std::vector<ForwardOutput> out;
  double t0 = Now();
  for (int s = 0; s <= steps; ++s) {
    if (s == 1) t0 = Now();
    for (size_t i = 0; i < n; ++i) {
      pos[i] = seqs[i]->last_position() + 1;
      step[i].kv = seqs[i];
      step[i].input.token_ids = absl::MakeConstSpan(&(*next)[i], 1);
      step[i].input.position_ids = absl::MakeConstSpan(&pos[i], 1);
      step[i].input.argmax_only = true;
    }
    Die(m.engine->Forward(step, &out), "decode");
    for (size_t i = 0; i < n; ++i) (*next)[i] = out[i].argmax[0];
  }
  const double per_step = (Now() - t0) / steps;
  m.engine->set_cuda_graphs(true);
  return per_step;
}

// Greedy decode of `steps` tokens of one sequence after its cache (see
// TimeDecodeSteps); seconds per token.
double TimeDecode(const Model& m, KvSequence* cache, int first_token,
                  int steps, bool graphs) {
  std::vector<int> next = {first_token};
  return TimeDecodeSteps(m, absl::MakeConstSpan(&cache, 1), &next, steps,
                         graphs);
}

// The batched decode stage: seconds per step of `batch` sequences decoding
// one token each together, from CUDA graphs and eagerly.
struct BatchedDecode {
  int batch = 0;
  double graph_step_s = 0;
  double eager_step_s = 0;
  int64_t graph_replays = 0;  // steps of the graph run that replayed
  std::string phases_json;    // --phase_times: an eager run's phases
};

// Tokens one batched decode sequence holds: its prompt, then an untimed
// and `steps` timed steps, eagerly and again from graphs, and `steps` more
// eager ones with the phase timer.
int BatchedDecodeTokens(int context, int steps) {
  return context + 3 * (steps + 1);
}

// Prefills `batch` fresh sequences of `context` random tokens (at most
// 2048 rows per forward, as a chunked prefill would), then times `steps`
// greedy decode steps of all of them together, eagerly and then from
// graphs, one untimed step before each (it captures the bucket's graph);
// the sequences are freed before it returns. Rows are argmax_only, as the
// services decode greedy requests.
BatchedDecode TimeBatchedDecode(const Model& m, int batch, int context,
                                int steps, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> tok(0, m.config.vocab_size - 1);
  std::vector<std::unique_ptr<KvSequence>> seqs;
  std::vector<int> next(batch);
  const int per_forward = std::max(1, 2048 / context);
  for (int b0 = 0; b0 < batch; b0 += per_forward) {
    const int nb = std::min(per_forward, batch - b0);
    std::vector<std::vector<int>> ids(nb), pos(nb);
    std::vector<SequenceForward> group(nb);
    for (int i = 0; i < nb; ++i) {
      seqs.push_back(NewCache(m, BatchedDecodeTokens(context, steps)));
      for (int t = 0; t < context; ++t) {
        ids[i].push_back(tok(rng));
        pos[i].push_back(t);
      }
      group[i].kv = seqs.back().get();
      group[i].input.token_ids = ids[i];
      group[i].input.position_ids = pos[i];
      group[i].input.argmax_only = true;
    }
    std::vector<ForwardOutput> out;
    Die(m.engine->Forward(group, &out), "batched prefill");
    for (int i = 0; i < nb; ++i) next[b0 + i] = out[i].argmax[0];
  }
  std::vector<KvSequence*> ptrs;
  for (const std::unique_ptr<KvSequence>& q : seqs) ptrs.push_back(q.get());
  BatchedDecode r;
  r.batch = batch;
  r.eager_step_s = TimeDecodeSteps(m, ptrs, &next, steps, false);
  const int64_t replays0 = m.engine->graph_replays();
  r.graph_step_s = TimeDecodeSteps(m, ptrs, &next, steps, true);
  r.graph_replays = m.engine->graph_replays() - replays0;
  if (absl::GetFlag(FLAGS_phase_times)) {
    // Where an eager step's time goes (graph replays are not timed): the
    // GEMMs at M = B, attention, the rest; launch gaps count in the phase
    // whose launch the GPU waited for.
    r.phases_json = PhaseTimes(
        m, absl::StrCat("the target's eager decode steps of B=", batch), context,
        [&] { TimeDecodeSteps(m, ptrs, &next, steps, false); });
  }
  return r;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "CUDA backend benchmark (Speculative Prefill + decode); see the header "
      "of bench/gpu/gpu_bench.cc.\n  gpu_bench --speculator DIR --target DIR "
      "[--json_out FILE]");
  absl::ParseCommandLine(argc, argv);
  if (!CudaAvailable()) {
    std::fprintf(stderr, "error: %s\n", CudaDeviceDescription().c_str());
    return 2;
  }
  const std::string spec_dir = absl::GetFlag(FLAGS_speculator);
  const std::string target_dir = absl::GetFlag(FLAGS_target);
  if (spec_dir.empty() || target_dir.empty()) {
    std::fprintf(stderr, "error: --speculator and --target are required\n");
    return 2;
  }
  const CudaDType dt = absl::GetFlag(FLAGS_dtype) == "fp16"
                           ? CudaDType::kFP16
                           : CudaDType::kBF16;
  const std::vector<int> lens = ParseInts(absl::GetFlag(FLAGS_prompt_lens));
  const std::vector<float> keeps = ParseFloats(absl::GetFlag(FLAGS_keep));
  const std::vector<int> ks = ParseInts(absl::GetFlag(FLAGS_verify_ks));
  const int lookahead = absl::GetFlag(FLAGS_lookahead);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const int service_chunk = std::max(1, absl::GetFlag(FLAGS_service_chunk));
  const int decode_steps = std::max(1, absl::GetFlag(FLAGS_decode_tokens));
  const std::vector<int> batches =
      ParseInts(absl::GetFlag(FLAGS_decode_batches));
  const int decode_context = absl::GetFlag(FLAGS_decode_context);
  if (absl::Status s =
          ValidateDecodeGemm(absl::GetFlag(FLAGS_decode_gemm));
      !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  for (int b : batches) {
    if (b < 1 || decode_context < 1) {
      std::fprintf(stderr, "error: --decode_batches entries and "
                           "--decode_context must be >= 1\n");
      return 2;
    }
  }

  Json top;
  const std::string device = CudaDeviceDescription();
  std::printf("device: %s\n", device.c_str());
  top.Str("device", device);
  top.Str("dtype", CudaDTypeName(dt));
  std::string cmd;
  for (int i = 0; i < argc; ++i) absl::StrAppend(&cmd, i ? " " : "", argv[i]);
  top.Str("command", cmd);

  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "error: cublasCreate failed\n");
    return 1;
  }
  const int peak_size = absl::GetFlag(FLAGS_peak_gemm_size);
  const int64_t copy_bytes = absl::GetFlag(FLAGS_copy_bytes);
  if (peak_size <= 0 || copy_bytes <= 0) {
    std::fprintf(stderr,
                 "error: --peak_gemm_size and --copy_bytes must be > 0\n");
    return 2;
  }
  const double peak = CublasPeakTflops(handle, dt, peak_size);
  const double copy_bw = CopyBandwidthGBps(static_cast<size_t>(copy_bytes));
  const double nominal_bw = NominalBandwidthGBps();
  std::printf("cuBLAS %s GEMM %d^3: %.1f TFLOP/s; D2D copy %.0f GB/s "
              "(nominal %.0f GB/s)\n",
              CudaDTypeName(dt), peak_size, peak, copy_bw, nominal_bw);
  top.Num("cublas_peak_tflops", peak);
  top.Num("copy_bandwidth_gbps", copy_bw);
  top.Num("nominal_bandwidth_gbps", nominal_bw);

  const int max_len = *std::max_element(lens.begin(), lens.end());
  const int max_k = ks.empty() ? 0 : *std::max_element(ks.begin(), ks.end());
  // Target: prefill, then decode steps, then a verify round on top.
  // Decode is timed twice (eager, graphs), one untimed step each.
  const int target_tokens = max_len + 2 * (decode_steps + 1) + max_k + 1 + 8;
  // Speculator: prefill, look-ahead steps, then decode steps.
  const int spec_tokens = max_len + lookahead + decode_steps + 1 + 8;
  // The batched decode stage's sequences, beside the long prompt's.
  const int max_batch =
      batches.empty() ? 0 : *std::max_element(batches.begin(), batches.end());
  const int batch_blocks =
      max_batch * PagedKvCache::BlocksForTokens(
                      BatchedDecodeTokens(decode_context, decode_steps),
                      KvCacheOptions().block_size);
  Model target = LoadModel(target_dir, dt, target_tokens, batch_blocks);
  Model spec = LoadModel(spec_dir, dt, spec_tokens);
  std::printf("target %s: %.1f GB on device, loaded in %.1f s; speculator "
              "%s: %.1f GB, %.1f s\n",
              target_dir.c_str(), target.weights->bytes() / 1e9,
              target.load_seconds, spec_dir.c_str(),
              spec.weights->bytes() / 1e9, spec.load_seconds);
  top.Num("target_weight_gb", target.weights->bytes() / 1e9);
  top.Num("speculator_weight_gb", spec.weights->bytes() / 1e9);

  // GEMM MFU of the target's projections at M = prompt length, using layer
  // 0's weights and random activations, each timed as the forward calls it
  // (EnqueueForward: fp32 output for qkv, fp32 with beta = 1, the residual
  // add, for o and down) and with a 16-bit output as the peak is timed.
  std::string gemm_json = "[";
  {
    // The four per-layer projections (lm_head is one matrix a forward).
    std::vector<ProjectionShape> shapes =
        ForwardProjections(target.config, dt);
    shapes.pop_back();
    std::printf("\nGEMM MFU (target projections on random activations, %% of "
                "the %.0f TFLOP/s cuBLAS peak; as the forward runs them / "
                "with a %s output):\n  M      qkv           o             "
                "gate_up       down\n",
                peak, CudaDTypeName(dt));
    for (int M : lens) {
      size_t max_in = 0, max_out = 0;  // q/k/v/o need not be hidden wide
      for (const ProjectionShape& s : shapes) {
        max_in = std::max<size_t>(max_in, s.in);
        max_out = std::max<size_t>(max_out, s.out);
      }
      const size_t x_elems = static_cast<size_t>(M) * max_in;
      const size_t y_elems = static_cast<size_t>(M) * max_out;
      absl::StatusOr<DeviceBuffer> x =
          DeviceBuffer::Allocate(CudaDTypeBytes(dt) * x_elems);
      absl::StatusOr<DeviceBuffer> y =
          DeviceBuffer::Allocate(sizeof(float) * y_elems);
      Die(x.status(), "alloc");
      Die(y.status(), "alloc");
      Die(FillNormal(x->get(), dt, x_elems, 3, nullptr), "fill");
      // beta = 1 reads it
      Die(FillNormal(y->get(), CudaDType::kF32, y_elems, 4, nullptr), "fill");
      std::printf("  %-6d", M);
      for (const ProjectionShape& s : shapes) {
        const void* w = ProjectionWeight(*target.weights, s.projection, 0);
        const auto tflops = [&](CudaDType out_dt, float beta) {
          double best = 1e30;
          for (int r = 0; r < 4; ++r) {
            const double t0 = Now();
            Die(CublasLinear(handle, dt, x->get(), M, s.in, w, s.out,
                             y->get(), out_dt, beta),
                "gemm");
            cudaDeviceSynchronize();
            if (r >= 1) best = std::min(best, Now() - t0);
          }
          return 2.0 * M * double(s.out) * s.in / best / 1e12;
        };
        const double forward = tflops(s.y_dtype, s.beta);
        const double narrow = tflops(dt, 0.0f);
        std::printf(" %5.1f/%5.1f%%", 100.0 * forward / peak,
                    100.0 * narrow / peak);
        if (gemm_json.size() > 1) gemm_json += ", ";
        gemm_json += absl::StrFormat(
            "{\"m\": %d, \"gemm\": \"%s\", \"out\": \"%s\", \"beta\": %.0f, "
            "\"tflops\": %.5g, \"mfu\": %.4f, \"tflops_%s_out\": %.5g}",
            M, ProjectionName(s.projection), CudaDTypeName(s.y_dtype), s.beta,
            forward, forward / peak, CudaDTypeName(dt), narrow);
      }
      std::printf("\n");
    }
  }
  gemm_json += "]";
  top.Raw("gemm", gemm_json);

  // What the services' start-up tuning (--prefill_attention=auto) keeps on
  // this GPU, to set against the per-length picks below; then back to the
  // default for those. Before the benchmark's sequences take the pools.
  // Where libcudnn does not load, --prefill_attention=cudnn runs
  // FlashAttention: the per-length rows then do not time a "cudnn" path.
  bool cudnn_loads = true;
  for (Model* m : {&target, &spec}) {
    const char* role = m == &target ? "target" : "speculator";
    absl::StatusOr<PrefillTuning> t = m->engine->TunePrefillAttention(
        kPrefillTuningContextTokens, kPrefillTuningChunkRows);
    if (t.ok()) {
      for (const PrefillPathTrial& trial : t->trials) {
        if (trial.name == "cudnn" && trial.note == kLibcudnnUnavailable) {
          cudnn_loads = false;
        }
      }
    }
    const std::string line = t.ok() ? DescribePrefillTuning(*t)
                                    : t.status().ToString();
    std::printf("%s start-up tuning: %s\n", role, line.c_str());
    top.Str(absl::StrCat(role, "_prefill_tuning"), line);
    m->engine->set_attention_path(CudaModelRunner::AttentionPath::kAuto);
  }
  // The few-row projections as the services choose them (--decode_gemm):
  // every decode, verify and look-ahead figure below runs on that choice.
  for (Model* m : {&target, &spec}) {
    const char* role = m == &target ? "target" : "speculator";
    absl::StatusOr<std::string> chosen =
        m->engine->ChooseDecodeGemm(absl::GetFlag(FLAGS_decode_gemm));
    const std::string line =
        chosen.ok() ? *chosen : chosen.status().ToString();
    std::printf("%s decode GEMM tuning: %s\n", role, line.c_str());
    top.Str(absl::StrCat(role, "_decode_gemm_tuning"), line);
  }

  // Batched decode of the target (issue 23's concurrent streams at the
  // engine): B sequences of decode_context tokens, one token each a step.
  std::mt19937_64 batch_rng(absl::GetFlag(FLAGS_seed) + 1);
  std::string batched_json = "[";
  if (!batches.empty()) {
    std::printf("\nbatched decode of the target at %d-token context "
                "(greedy on the device; tokens/s of all B sequences):\n"
                "  B      graph_ms  tok/s     x_B1    bw%%     eager_ms  "
                "eager_tok/s  replayed\n",
                decode_context);
  }
  double batch1_tok_s = 0;
  for (int b : batches) {
    const BatchedDecode d = TimeBatchedDecode(target, b, decode_context,
                                              decode_steps, batch_rng);
    const double tok_s = b / d.graph_step_s;
    if (b == 1) batch1_tok_s = tok_s;
    // Context during the timed graph steps: after the prompt, the eager
    // steps and half the graph steps.
    const int ctx = decode_context + decode_steps + 1 + decode_steps / 2;
    const double gbps = DecodeBytes(target, ctx, dt, b) / d.graph_step_s / 1e9;
    const std::string x_b1 =
        batch1_tok_s > 0 ? absl::StrFormat("%.1fx", tok_s / batch1_tok_s)
                         : "-";
    std::printf("  %-6d %8.3f  %-9.1f %-7s %6.1f%%  %8.3f  %-11.1f  %lld/%d\n",
                b, 1e3 * d.graph_step_s, tok_s, x_b1.c_str(),
                100 * gbps / copy_bw, 1e3 * d.eager_step_s,
                b / d.eager_step_s, static_cast<long long>(d.graph_replays),
                decode_steps + 1);
    Json row;
    row.Num("batch", b);
    row.Num("context", decode_context);
    row.Num("graph_step_s", d.graph_step_s);
    row.Num("tok_s", tok_s);
    row.Num("eager_step_s", d.eager_step_s);
    row.Num("eager_tok_s", b / d.eager_step_s);
    row.Num("graph_replays", static_cast<double>(d.graph_replays));
    row.Num("gbps", gbps);
    row.Num("bw_fraction", gbps / copy_bw);
    if (batch1_tok_s > 0) row.Num("x_batch1", tok_s / batch1_tok_s);
    if (!d.phases_json.empty()) row.Raw("eager_phases", d.phases_json);
    if (batched_json.size() > 1) batched_json += ", ";
    batched_json += row.Done();
  }
  batched_json += "]";
  top.Raw("batched_decode", batched_json);

  std::unique_ptr<KvSequence> tcache = NewCache(target, target_tokens);
  std::unique_ptr<KvSequence> scache = NewCache(spec, spec_tokens);
  absl::StatusOr<std::unique_ptr<QueryCapture>> capture =
      spec.engine->NewQueryCapture(1 + lookahead);
  Die(capture.status(), "capture");

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::uniform_int_distribution<int> tok(
      0, std::min(target.config.vocab_size, spec.config.vocab_size) - 1);

  // Warm-up: cuBLAS heuristics, kernel loading. No longer than the
  // longest prompt: the KV pools are sized for that.
  {
    const int n = std::min(512, max_len);
    std::vector<int> ids(n), pos(n);
    for (int i = 0; i < n; ++i) ids[i] = tok(rng), pos[i] = i;
    TimePrefill(target, tcache.get(), ids, pos);
    TimePrefill(spec, scache.get(), ids, pos);
  }

  std::string rows_json = "[";
  std::string phases_json = "[";  // --phase_times, one object per length
  std::printf("\n%-6s %9s %9s %9s %9s %9s %9s %8s %8s %9s %9s\n", "prompt",
              "full_s", "score_s", "keep", "kept_s", "ttft_s", "speedup",
              "tgt_MFU", "dec_t/s", "dec_bw%", "spec_t/s");
  for (int P : lens) {
    std::vector<int> ids(P), pos(P);
    for (int i = 0; i < P; ++i) ids[i] = tok(rng), pos[i] = i;

    // Target: full prefill (its last row's logits kept as the reference
    // of the other kernels).
    std::vector<double> full;
    std::vector<float> ref_logits;
    for (int r = 0; r < reps; ++r) {
      full.push_back(TimePrefill(target, tcache.get(), ids, pos,
                                 r == 0 ? &ref_logits : nullptr));
    }
    const double t_full = MedianSeconds(full);
    // The same with FlashMmaAttention (--prefill_attention=mma) and with
    // cuDNN's SDPA (--prefill_attention=cudnn; its plan is built by the
    // untimed first run), then back to the default. Each prints how far its
    // last-row logits are from the default's. The services' start-up rule
    // (ChoosePrefillTrial: the fastest whose top-1 agrees up to a near tie,
    // cuDNN within 5% of it) picks the path that runs the rest of the row
    // (scoring, kept prefills).
    std::vector<PrefillPathTrial> trials(1);
    std::vector<CudaModelRunner::AttentionPath> paths = {
        CudaModelRunner::AttentionPath::kAuto};
    trials[0].name = "flash";  // --prefill_attention=flash, the reference
    trials[0].ran = true;
    trials[0].agrees = true;
    trials[0].seconds = t_full;
    auto time_path = [&](CudaModelRunner::AttentionPath path,
                         const char* name) {
      target.engine->set_attention_path(path);
      std::vector<float> logits;
      TimePrefill(target, tcache.get(), ids, pos, &logits);
      std::vector<double> ts;
      for (int r = 0; r < reps; ++r) {
        ts.push_back(TimePrefill(target, tcache.get(), ids, pos));
      }
      target.engine->set_attention_path(CudaModelRunner::AttentionPath::kAuto);
      PrefillPathTrial t;
      t.name = name;
      t.ran = true;
      t.seconds = MedianSeconds(ts);
      t.max_rel_diff = MaxRelDiff(ref_logits, logits);
      t.agrees = TopOneAgrees(ref_logits, logits);
      std::printf("%s at %d: last-row logits max rel diff %.2e vs default, "
                  "top-1 %s\n",
                  name, P, t.max_rel_diff, t.agrees ? "agrees" : "DIFFERS");
      trials.push_back(t);
      paths.push_back(path);
      return t.seconds;
    };
    const double t_full_mma =
        time_path(CudaModelRunner::AttentionPath::kFlashMma, "mma");
    // 0 = not run (libcudnn does not load here).
    double t_full_cudnn = 0;
    if (cudnn_loads) {
      t_full_cudnn = time_path(CudaModelRunner::AttentionPath::kCudnn, "cudnn");
    } else {
      std::printf("cudnn at %d: not run (%s)\n", P, kLibcudnnUnavailable);
    }
    const int chosen = ChoosePrefillTrial(trials);
    const CudaModelRunner::AttentionPath best = paths[chosen];
    const char* best_name = trials[chosen].name.c_str();
    const double t_best = trials[chosen].seconds;
    target.engine->set_attention_path(best);
    spec.engine->set_attention_path(best);
    std::printf("prefill attention for the rest of the %d row: %s\n", P,
                best_name);
    const double flops =
        LayerFlopsPerToken(target.config) * P +
        AttentionFlops(target.config, P) +
        2.0 * target.config.hidden_size * double(target.config.vocab_size);
    const double mfu = flops / t_full / 1e12 / peak;

    // Target decode after the full prefill (context P).
    const double t_dec_eager =
        TimeDecode(target, tcache.get(), ids[0], decode_steps, false);
    const double t_dec =
        TimeDecode(target, tcache.get(), ids[0], decode_steps, true);
    const double dec_bw =
        DecodeBytes(target, P + decode_steps / 2, dt) / t_dec / 1e9;

    // Verify rounds at context P: k + 1 rows, all logits, rolled back.
    std::string verify_json = "[";
    for (int k : ks) {
      const int base = tcache->size();
      std::vector<int> vids(k + 1), vpos(k + 1), rows(k + 1);
      for (int i = 0; i <= k; ++i) {
        vids[i] = tok(rng);
        vpos[i] = tcache->last_position() + 1 + i;
        rows[i] = i;
      }
      std::vector<double> ts;
      for (int r = 0; r < reps + 2; ++r) {
        ForwardInput in;
        in.token_ids = vids;
        in.position_ids = vpos;
        in.logit_rows = rows;
        ForwardOutput out;
        const double t0 = Now();
        Die(target.engine->Forward(in, tcache.get(), &out), "verify");
        ts.push_back(Now() - t0);
        Die(tcache->Truncate(base), "truncate");
      }
      if (verify_json.size() > 1) verify_json += ", ";
      verify_json += absl::StrFormat("{\"k\": %d, \"seconds\": %.6f}", k,
                                     MedianSeconds(ts));
    }
    verify_json += "]";
    const std::string cudnn_s =
        cudnn_loads ? absl::StrFormat("%.4f s", t_full_cudnn) : "not run";
    std::printf("target full prefill at %d: %.4f s (WMMA FlashAttention), "
                "%.4f s (FlashMmaAttention), %s (cuDNN SDPA); decode "
                "%.1f tok/s from graphs, %.1f eager\n",
                P, t_full, t_full_mma, cudnn_s.c_str(), 1.0 / t_dec,
                1.0 / t_dec_eager);
    std::printf("verify rounds at context %d (k: seconds): %s\n", P,
                verify_json.c_str());

    // Speculator: scoring = prefill with capture + look-ahead + reduction +
    // selection; then its decode rate at context P.
    std::vector<double> t_score, t_prefill_s, t_look, t_reduce;
    std::vector<float> importance;
    for (int r = 0; r < reps; ++r) {
      scache->Clear();
      (*capture)->Clear();
      const double t0 = Now();
      // The captured query rows stay on the device, in `capture`.
      SequenceForward f;
      f.kv = scache.get();
      f.capture = capture->get();
      f.input.token_ids = ids;
      f.input.position_ids = pos;
      f.input.capture_query_rows = {P - 1};
      std::vector<ForwardOutput> out;
      Die(spec.engine->Forward(absl::MakeConstSpan(&f, 1), &out),
          "spec prefill");
      const double t1 = Now();
      int next = specserve::Argmax(out[0].logits);
      for (int s = 0; s < lookahead; ++s) {
        const int p = P + s;
        SequenceForward d;
        d.kv = scache.get();
        d.capture = capture->get();
        d.input.token_ids = absl::MakeConstSpan(&next, 1);
        d.input.position_ids = absl::MakeConstSpan(&p, 1);
        d.input.capture_query_rows = {0};
        // Greedy on the device, as the speculator service's look-ahead
        // (graphed: a capturing one-row step).
        d.input.argmax_only = true;
        Die(spec.engine->Forward(absl::MakeConstSpan(&d, 1), &out),
            "look-ahead");
        next = out[0].argmax[0];
      }
      const double t2 = Now();
      absl::StatusOr<ImportanceResult> imp = spec.engine->ScoreImportance(
          *scache, P, **capture, ScoringOptions(), /*num_threads=*/1);
      Die(imp.status(), "score");
      importance = std::move(imp->importance);
      const double t3 = Now();
      t_prefill_s.push_back(t1 - t0);
      t_look.push_back(t2 - t1);
      t_reduce.push_back(t3 - t2);
      t_score.push_back(t3 - t0);
    }
    const double spec_dec =
        TimeDecode(spec, scache.get(), ids[0], decode_steps, true);
    // The scoring prefill as the speculator service runs it: chunks of
    // --service_chunk rows.
    const auto spec_chunked = [&](int chunk) {
      return MedianOfRuns(reps, [&] {
        return TimeChunkedPrefill(spec, scache.get(), capture->get(), ids,
                                  pos, chunk);
      });
    };
    const double t_spec_chunked = spec_chunked(service_chunk);
    std::string alt;
    const int alt_chunk = absl::GetFlag(FLAGS_alt_service_chunk);
    if (alt_chunk > 0 && alt_chunk != service_chunk) {
      alt = absl::StrFormat(", %.4f s in %d-row chunks",
                            spec_chunked(alt_chunk), alt_chunk);
    }
    std::printf("speculator prefill at %d: %.4f s in one pass, %.4f s in "
                "%d-row chunks (as its service runs it)%s\n",
                P, MedianSeconds(t_prefill_s), t_spec_chunked, service_chunk,
                alt.c_str());

    // Kept-token prefills.
    std::string kept_for_phases;  // the first keep's, for --phase_times
    std::vector<int> kept_ids_for_phases, kept_pos_for_phases;
    for (float keep : keeps) {
      SelectionOptions sel;
      sel.keep_ratio = keep;
      sel.chunk_size = absl::GetFlag(FLAGS_chunk_size);
      const double ts0 = Now();
      absl::StatusOr<Selection> s = SelectTokens(importance, sel);
      const double t_select = Now() - ts0;
      Die(s.status(), "select");
      std::vector<int> kept_ids;
      for (int i : s->kept_indices) kept_ids.push_back(ids[i]);
      std::vector<double> kt;
      for (int r = 0; r < reps; ++r) {
        kt.push_back(TimePrefill(target, tcache.get(), kept_ids,
                                 s->position_ids));
      }
      const double t_kept = MedianSeconds(kt);
      const double t_kept_chunked = MedianOfRuns(reps, [&] {
        return TimeChunkedPrefill(target, tcache.get(), nullptr, kept_ids,
                                  s->position_ids, service_chunk);
      });
      std::printf("target kept prefill at %d, keep %.2f (%zu tokens): %.4f s "
                  "in one pass, %.4f s in %d-row chunks (as its service runs "
                  "it)\n",
                  P, keep, kept_ids.size(), t_kept, t_kept_chunked,
                  service_chunk);
      if (kept_ids_for_phases.empty()) {
        kept_for_phases = absl::StrFormat("the target's kept prefill (keep "
                                          "%.2f, %zu tokens)",
                                          keep, kept_ids.size());
        kept_ids_for_phases = kept_ids;
        kept_pos_for_phases = s->position_ids;
      }
      const double t_scoring = MedianSeconds(t_score) + t_select;
      const double ttft = t_scoring + t_kept;
      std::printf("%-6d %9.4f %9.4f %9.2f %9.4f %9.4f %8.2fx %7.1f%% %8.1f "
                  "%8.1f%% %9.1f\n",
                  P, t_best, t_scoring, keep, t_kept, ttft, t_best / ttft,
                  100 * mfu, 1.0 / t_dec, 100 * dec_bw / copy_bw,
                  1.0 / spec_dec);
      Json row;
      row.Num("prompt_len", P);
      row.Num("keep", keep);
      row.Num("kept_tokens", s->kept_indices.size());
      row.Num("target_full_prefill_s", t_full);
      row.Num("target_full_prefill_tflops", flops / t_full / 1e12);
      row.Num("target_full_prefill_mma_s", t_full_mma);
      if (cudnn_loads) row.Num("target_full_prefill_cudnn_s", t_full_cudnn);
      // The fastest path that agrees with the default ran the scoring and
      // the kept prefills; the speedup is against its full prefill.
      row.Str("attention_path", best_name);
      row.Num("target_best_full_prefill_s", t_best);
      row.Num("target_full_prefill_mfu", mfu);
      row.Num("target_kept_prefill_s", t_kept);
      row.Num("target_kept_prefill_chunked_s", t_kept_chunked);
      row.Num("spec_prefill_s", MedianSeconds(t_prefill_s));
      row.Num("spec_prefill_chunked_s", t_spec_chunked);
      row.Num("service_chunk", service_chunk);
      row.Num("spec_lookahead_s", MedianSeconds(t_look));
      row.Num("spec_reduce_s", MedianSeconds(t_reduce));
      row.Num("select_s", t_select);
      row.Num("scoring_s", t_scoring);
      row.Num("ttft_s", ttft);
      row.Num("ttft_speedup", t_best / ttft);
      row.Num("target_decode_tok_s", 1.0 / t_dec);
      row.Num("target_decode_eager_tok_s", 1.0 / t_dec_eager);
      row.Num("target_decode_gbps", dec_bw);
      row.Num("target_decode_bw_fraction", dec_bw / copy_bw);
      row.Num("spec_decode_tok_s", 1.0 / spec_dec);
      row.Raw("verify", verify_json);
      if (rows_json.size() > 1) rows_json += ", ";
      rows_json += row.Done();
    }
    if (absl::GetFlag(FLAGS_phase_times)) {
      // Where each prefill's time goes, on the paths that ran above.
      Json ph;
      ph.Num("prompt_len", P);
      ph.Raw("target_full_prefill",
             PhaseTimes(target, "the target's full prefill", P,
                        [&] { TimePrefill(target, tcache.get(), ids, pos); }));
      ph.Raw("spec_prefill",
             PhaseTimes(spec, "the speculator's prefill in one pass", P, [&] {
               TimeChunkedPrefill(spec, scache.get(), capture->get(), ids,
                                  pos, P);
             }));
      ph.Raw("spec_prefill_chunked",
             PhaseTimes(spec,
                        absl::StrCat("the speculator's prefill in ",
                                     service_chunk, "-row chunks"),
                        P, [&] {
                          TimeChunkedPrefill(spec, scache.get(),
                                             capture->get(), ids, pos,
                                             service_chunk);
                        }));
      if (!kept_ids_for_phases.empty()) {
        ph.Raw("target_kept_prefill_chunked",
               PhaseTimes(target,
                          absl::StrCat(kept_for_phases, " in ",
                                       service_chunk, "-row chunks"),
                          P, [&] {
                            TimeChunkedPrefill(target, tcache.get(), nullptr,
                                               kept_ids_for_phases,
                                               kept_pos_for_phases,
                                               service_chunk);
                          }));
      }
      if (phases_json.size() > 1) phases_json += ", ";
      phases_json += ph.Done();
    }
    target.engine->set_attention_path(CudaModelRunner::AttentionPath::kAuto);
    spec.engine->set_attention_path(CudaModelRunner::AttentionPath::kAuto);
  }
  rows_json += "]";
  top.Raw("rows", rows_json);
  phases_json += "]";
  top.Raw("phases", phases_json);
  cublasDestroy(handle);

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    std::ofstream f(json_out);
    f << top.Done() << "\n";
    if (!f) {
      std::fprintf(stderr, "error: cannot write %s\n", json_out.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", json_out.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) { return specserve::Main(argc, argv); }
