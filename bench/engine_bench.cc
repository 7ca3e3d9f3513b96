// CPU engine benchmark: prefill and decode tokens/s of the bundled models
// and synthetic random-weight checkpoints with real shapes, next to
// OpenBLAS's own sgemm rate at the same GEMM shapes and the machine's
// memory bandwidth, all measured in this run.
//
//   bazel run -c opt //bench:engine_bench [-- --models=... --lengths=...]
//
// Prefill "useful GFLOP/s" counts the linear layers (2 * params * tokens),
// the causal attention and one lm_head row. The sgemm column is the rate
// OpenBLAS reaches on exactly the engine's per-layer GEMM shapes at M =
// prompt length (time-weighted), so "% sgemm" is how close the whole forward
// gets to its GEMM ceiling. Decode reads every weight once per token:
// "x read" is decode time / (weight bytes / triad bandwidth). The batched
// decode table (--batch_model, --batch_sizes) runs B sequences one row each
// per forward: the weights are read once per step for all B rows.
// --kv_cache_dtype f32|bf16 picks the KV cache's element type; the batched
// table then also reports the pool bytes the sequences hold and the
// process's resident memory growth over their prefill (--batch_context
// tokens each: set it high to measure long-context decode).

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <numeric>
#include <optional>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/engine/cpu_model_runner.h"

ABSL_FLAG(std::string, models,
          "stories260K,stories260K-draft,tinystories-656K,synthetic:llama2-15m,"
          "synthetic:llama2-110m,synthetic:llama-3.2-1b",
          "comma-separated: bundled model names or synthetic:<preset>");
ABSL_FLAG(std::string, lengths, "128,512,2048", "prompt lengths (tokens)");
ABSL_FLAG(int, decode_tokens, 32, "decode steps timed per model");
ABSL_FLAG(int, threads, 2, "GEMM threads");
ABSL_FLAG(int, reps, 2, "timed repetitions per prefill (best is reported)");
ABSL_FLAG(std::string, batch_model, "synthetic:llama2-110m",
          "model of the batched decode table (empty = skip it)");
ABSL_FLAG(std::string, batch_sizes, "1,4,16,64",
          "sequences decoded together, one row each per forward");
ABSL_FLAG(std::string, weight_dtypes, "auto",
          "comma-separated weight dtypes each model runs in, one after the "
          "other: auto (the checkpoint's), f32, bf16, int8");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "KV cache element type: auto (f32), f32 or bf16");
ABSL_FLAG(int, batch_context, 128,
          "tokens each batched sequence holds before the timed steps");

namespace specserve {
namespace bench {
namespace {

// --weight_dtypes, parsed (nullopt = auto).
std::vector<std::optional<WeightDType>> WeightDTypes() {
  std::vector<std::optional<WeightDType>> out;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_weight_dtypes), ',')) {
    auto t = ParseWeightDType(std::string(s));
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      std::exit(2);
    }
    out.push_back(*t);
  }
  return out;
}

// --kv_cache_dtype, parsed (auto = f32, the CPU default).
KvCacheDType KvDType() {
  auto t = ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    std::exit(2);
  }
  return t->value_or(KvCacheDType::kF32);
}

std::string DTypeLabel(const CpuModelRunner& r) {
  return WeightDTypeName(r.weight_dtype()) + " (" +
         PackedKernelName(r.weight_dtype()) + ")";
}

// Time-weighted sgemm rate over the engine's per-layer GEMMs at M = n.
double SgemmRateForModel(const ModelConfig& c, int n) {
  const int h = c.hidden_size;
  const std::vector<std::array<int, 2>> shapes = {
      {c.qkv_dim(), h},
      {h, c.num_attention_heads * c.head_dim},
      {2 * c.intermediate_size, h},
      {h, c.intermediate_size}};
  double flops = 0, secs = 0;
  for (auto [out, in] : shapes) {
    const double f = 2.0 * n * out * in;
    flops += f;
    secs += f / (SgemmGflops(n, out, in, 2) * 1e9);
  }
  return flops / secs / 1e9;
}

// Batched decode: B sequences, each holding batch_context tokens, decode
// one row each per forward (ModelRunner's batch). A decode step streams
// every weight once however many rows it carries, so tokens/s should grow
// nearly linearly with B until the GEMMs become compute-bound.
int RunBatchedDecode(double bw, std::optional<WeightDType> dtype) {
  const std::string spec = absl::GetFlag(FLAGS_batch_model);
  auto w = LoadBenchModel(spec);
  if (!w.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.c_str(),
                 w.status().ToString().c_str());
    return 1;
  }
  std::vector<int> sizes;
  for (auto b : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',')) {
    sizes.push_back(std::stoi(std::string(b)));
  }
  const ModelConfig& c = (*w)->config;
  const int steps = absl::GetFlag(FLAGS_decode_tokens);
  const int ctx = std::min(absl::GetFlag(FLAGS_batch_context),
                           c.max_position_embeddings - steps - 1);
  const int max_b = *std::max_element(sizes.begin(), sizes.end());
  KvCacheOptions o;
  o.dtype = KvDType();
  o.pool_bytes = CpuModelRunner::BytesPerToken(c, o.dtype) *
                 (static_cast<size_t>(max_b) * (ctx + steps + 16) + ctx);
  auto runner = CpuModelRunner::Create(*w, o, dtype);
  if (!runner.ok()) {
    std::fprintf(stderr, "%s\n", runner.status().ToString().c_str());
    return 1;
  }
  ModelRunner& model = **runner;
  std::mt19937 rng(1);
  // Every sequence gets its own prompt and KV blocks (as served requests
  // do: attention then reads B distinct caches), prefilled 16 at a time.
  std::vector<std::unique_ptr<KvSequence>> seqs;
  for (int i = 0; i < max_b; ++i) {
    auto seq = model.NewSequence(ctx + steps + 1);
    if (!seq.ok()) {
      std::fprintf(stderr, "%s\n", seq.status().ToString().c_str());
      return 1;
    }
    seqs.push_back(std::move(*seq));
  }
  std::vector<int> ids(size_t(max_b) * ctx), pos(ctx);
  for (int& t : ids) t = rng() % c.vocab_size;
  std::iota(pos.begin(), pos.end(), 0);
  // The pool's pages are committed as blocks are first written: RSS grows
  // by the KV the prefill stores (plus the first forward's activations).
  const double rss_before = ProcStatusBytes("VmRSS");
  for (int i0 = 0; i0 < max_b; i0 += 16) {
    std::vector<SequenceForward> prefill;
    for (int i = i0; i < std::min(max_b, i0 + 16); ++i) {
      SequenceForward f;
      f.kv = seqs[i].get();
      f.input.token_ids = absl::MakeConstSpan(&ids[size_t(i) * ctx], ctx);
      f.input.position_ids = pos;
      prefill.push_back(std::move(f));
    }
    std::vector<ForwardOutput> outs;
    if (absl::Status st = model.Forward(prefill, &outs); !st.ok()) {
      std::fprintf(stderr, "prefill: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  const double rss_growth = ProcStatusBytes("VmRSS") - rss_before;
  const double weight_mb = (*runner)->weight_bytes() / 1e6;
  const PagedKvCache& kv = model.kv_cache();
  std::printf(
      "\nBatched decode, %s, %s weights (%.0f MB), %s KV cache (%zu bytes "
      "per token; %d sequences x %d tokens hold %.1f MB of blocks, RSS grew "
      "%.1f MB over their prefill), median of %d steps\n\n| batch | step "
      "ms | tokens/s (all sequences) | x batch 1 | weight reads / s "
      "|\n|---|---|---|---|---|\n",
      spec.c_str(), DTypeLabel(**runner).c_str(), weight_mb,
      KvCacheDTypeName(o.dtype).c_str(), kv.bytes_per_token(), max_b, ctx,
      kv.bytes_used() / 1e6, rss_growth / 1e6, steps);
  double base = 0;
  for (int b : sizes) {
    // Back to the prompt: every batch size decodes at the same context.
    for (int i = 0; i < b; ++i) {
      if (!seqs[i]->Truncate(ctx).ok()) return 1;
    }
    std::vector<int> tok(b), p(b, ctx);
    for (int& t : tok) t = rng() % c.vocab_size;
    std::vector<SequenceForward> batch(b);
    std::vector<ForwardOutput> outs;
    std::vector<double> times;
    for (int s = 0; s <= steps; ++s) {
      for (int i = 0; i < b; ++i) {
        batch[i].kv = seqs[i].get();
        batch[i].input.token_ids = absl::MakeConstSpan(&tok[i], 1);
        batch[i].input.position_ids = absl::MakeConstSpan(&p[i], 1);
      }
      const double t0 = Now();
      if (absl::Status st = model.Forward(batch, &outs); !st.ok()) {
        std::fprintf(stderr, "batch %d: %s\n", b, st.ToString().c_str());
        return 1;
      }
      if (s > 0) times.push_back(Now() - t0);  // step 0 warms up
      for (int i = 0; i < b; ++i) {
        tok[i] = rng() % c.vocab_size;
        ++p[i];
      }
    }
    // The median step: robust to the other tenants of a shared VM.
    std::nth_element(times.begin(), times.begin() + times.size() / 2,
                     times.end());
    const double step = times[times.size() / 2];
    const double tok_s = b / step;
    if (base == 0) base = tok_s;
    std::printf("| %d | %.2f | %.0f | %.1fx | %.1f (%.0f GB/s) |\n", b,
                step * 1e3, tok_s, tok_s / base, 1 / step,
                weight_mb / 1e3 / step);
    std::fflush(stdout);
  }
  std::printf("\nSTREAM triad bandwidth: %.1f GB/s\n", bw);
  return 0;
}

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  std::vector<int> lengths;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_lengths), ',')) {
    lengths.push_back(std::stoi(std::string(s)));
  }
  const double bw = TriadGBps(absl::GetFlag(FLAGS_threads));
  std::printf("OpenBLAS core: %s, threads: %d\n", OpenBlasCoreName().c_str(),
              absl::GetFlag(FLAGS_threads));
  std::printf("STREAM triad bandwidth: %.1f GB/s\n\n", bw);
  std::printf(
      "| model | weights | prompt | prefill tok/s | prefill GFLOP/s | "
      "sgemm GFLOP/s | %% sgemm |\n|---|---|---|---|---|---|---|\n");
  struct DecodeRow {
    std::string model, dtype;
    double tok_s, weight_mb, read_ms, x_read;
  };
  std::vector<DecodeRow> decode_rows;
  std::mt19937 rng(0);
  for (auto spec : absl::StrSplit(absl::GetFlag(FLAGS_models), ',')) {
    auto w = LoadBenchModel(std::string(spec));
    if (!w.ok()) {
      std::fprintf(stderr, "%s: %s\n", std::string(spec).c_str(),
                   w.status().ToString().c_str());
      return 1;
    }
    for (std::optional<WeightDType> dtype : WeightDTypes()) {
      // Room for one prefill or decode sequence at a time.
      auto runner =
          CpuModelRunner::CreateForSequences(*w, 1, 16, dtype, KvDType());
      if (!runner.ok()) {
        std::fprintf(stderr, "%s\n", runner.status().ToString().c_str());
        return 1;
      }
      const std::string label = DTypeLabel(**runner);
      ModelRunner& model = **runner;
      const ModelConfig& c = model.config();
      for (int n : lengths) {
        const int decode = absl::GetFlag(FLAGS_decode_tokens);
        if (n + decode > c.max_position_embeddings) continue;
        std::vector<int> ids(n), pos(n);
        for (int& t : ids) t = rng() % c.vocab_size;
        std::iota(pos.begin(), pos.end(), 0);
        double best = 1e30;
        for (int r = 0; r <= absl::GetFlag(FLAGS_reps); ++r) {
          auto cache = model.NewSequence(n + decode);
          if (!cache.ok()) return 1;
          ForwardInput in;
          in.token_ids = ids;
          in.position_ids = pos;
          ForwardOutput out;
          const double t0 = Now();
          if (!model.Forward(in, cache->get(), &out).ok()) return 1;
          const double t = Now() - t0;
          if (r > 0 || absl::GetFlag(FLAGS_reps) == 0) best = std::min(best, t);
        }
        const double flops = LayerFlopsPerToken(c) * n + AttentionFlops(c, n) +
                             2.0 * c.hidden_size * c.vocab_size;
        const double gf = flops / best / 1e9;
        const double sg = SgemmRateForModel(c, n);
        std::printf("| %s | %s | %d | %.0f | %.1f | %.1f | %.0f%% |\n",
                    std::string(spec).c_str(), label.c_str(), n, n / best, gf,
                    sg, 100 * gf / sg);
        std::fflush(stdout);
      }
      // Decode: 128-token prompt, then single-token steps.
      const int n = std::min(128, c.max_position_embeddings / 2);
      const int steps = absl::GetFlag(FLAGS_decode_tokens);
      auto cache_or = model.NewSequence(n + steps + 1);
      if (!cache_or.ok()) return 1;
      KvSequence* cache = cache_or->get();
      std::vector<int> ids(n), pos(n);
      for (int& t : ids) t = rng() % c.vocab_size;
      std::iota(pos.begin(), pos.end(), 0);
      ForwardInput in;
      in.token_ids = ids;
      in.position_ids = pos;
      ForwardOutput out;
      if (!model.Forward(in, cache, &out).ok()) return 1;
      const double t0 = Now();
      for (int i = 0; i < steps; ++i) {
        const int tok = rng() % c.vocab_size, p = n + i;
        ForwardInput step;
        step.token_ids = absl::MakeConstSpan(&tok, 1);
        step.position_ids = absl::MakeConstSpan(&p, 1);
        if (!model.Forward(step, cache, &out).ok()) return 1;
      }
      const double per_tok = (Now() - t0) / steps;
      const double bytes = (*runner)->weight_bytes();
      const double read_s = bytes / (bw * 1e9);
      decode_rows.push_back({std::string(spec), label, 1 / per_tok, bytes / 1e6,
                             read_s * 1e3, per_tok / read_s});
    }
  }
  std::printf(
      "\n| model | weights | decode tok/s | weights MB | weight read ms | "
      "decode / read |\n|---|---|---|---|---|---|\n");
  for (const auto& r : decode_rows) {
    std::printf("| %s | %s | %.1f | %.1f | %.2f | %.2fx |\n",
                r.model.c_str(), r.dtype.c_str(), r.tok_s, r.weight_mb,
                r.read_ms, r.x_read);
  }
  if (absl::GetFlag(FLAGS_batch_model).empty()) return 0;
  for (std::optional<WeightDType> dtype : WeightDTypes()) {
    if (int rc = RunBatchedDecode(bw, dtype); rc != 0) return rc;
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  return specserve::bench::Run();
}
