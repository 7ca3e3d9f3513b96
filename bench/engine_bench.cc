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
// "x read" is decode time / (weight bytes / triad bandwidth).

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/engine/transformer.h"

ABSL_FLAG(std::string, models,
          "stories260K,stories260K-draft,tinystories-656K,synthetic:llama2-15m,"
          "synthetic:llama2-110m,synthetic:llama-3.2-1b",
          "comma-separated: bundled model names or synthetic:<preset>");
ABSL_FLAG(std::string, lengths, "128,512,2048", "prompt lengths (tokens)");
ABSL_FLAG(int, decode_tokens, 32, "decode steps timed per model");
ABSL_FLAG(int, threads, 2, "GEMM threads");
ABSL_FLAG(int, reps, 2, "timed repetitions per prefill (best is reported)");

namespace specserve {
namespace bench {
namespace {

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

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  std::vector<int> lengths;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_lengths), ',')) {
    lengths.push_back(std::stoi(std::string(s)));
  }
  const double bw = TriadGBps(absl::GetFlag(FLAGS_threads));
  std::printf("OpenBLAS core: %s, threads: %d\n", BlasCoreName().c_str(),
              absl::GetFlag(FLAGS_threads));
  std::printf("STREAM triad bandwidth: %.1f GB/s\n\n", bw);
  std::printf(
      "| model | prompt | prefill tok/s | prefill GFLOP/s | sgemm GFLOP/s | "
      "%% sgemm |\n|---|---|---|---|---|---|\n");
  struct DecodeRow {
    std::string model;
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
    Transformer model(*w);
    const ModelConfig& c = model.config();
    for (int n : lengths) {
      if (n + absl::GetFlag(FLAGS_decode_tokens) > c.max_position_embeddings) {
        continue;
      }
      std::vector<int> ids(n), pos(n);
      for (int& t : ids) t = rng() % c.vocab_size;
      std::iota(pos.begin(), pos.end(), 0);
      double best = 1e30;
      for (int r = 0; r <= absl::GetFlag(FLAGS_reps); ++r) {
        KvCache cache(c, n + absl::GetFlag(FLAGS_decode_tokens));
        ForwardInput in;
        in.token_ids = ids;
        in.position_ids = pos;
        ForwardOutput out;
        const double t0 = Now();
        if (!model.Forward(in, &cache, &out).ok()) return 1;
        const double t = Now() - t0;
        if (r > 0 || absl::GetFlag(FLAGS_reps) == 0) best = std::min(best, t);
      }
      const double flops = LayerFlopsPerToken(c) * n + AttentionFlops(c, n) +
                           2.0 * c.hidden_size * c.vocab_size;
      const double gf = flops / best / 1e9;
      const double sg = SgemmRateForModel(c, n);
      std::printf("| %s | %d | %.0f | %.1f | %.1f | %.0f%% |\n",
                  std::string(spec).c_str(), n, n / best, gf, sg,
                  100 * gf / sg);
      std::fflush(stdout);
    }
    // Decode: 128-token prompt, then single-token steps.
    const int n = std::min(128, c.max_position_embeddings / 2);
    const int steps = absl::GetFlag(FLAGS_decode_tokens);
    KvCache cache(c, n + steps + 1);
    std::vector<int> ids(n), pos(n);
    for (int& t : ids) t = rng() % c.vocab_size;
    std::iota(pos.begin(), pos.end(), 0);
    ForwardInput in;
    in.token_ids = ids;
    in.position_ids = pos;
    ForwardOutput out;
    if (!model.Forward(in, &cache, &out).ok()) return 1;
    const double t0 = Now();
    for (int i = 0; i < steps; ++i) {
      const int tok = rng() % c.vocab_size, p = n + i;
      ForwardInput step;
      step.token_ids = absl::MakeConstSpan(&tok, 1);
      step.position_ids = absl::MakeConstSpan(&p, 1);
      if (!model.Forward(step, &cache, &out).ok()) return 1;
    }
    const double per_tok = (Now() - t0) / steps;
    const double bytes = (*w)->bytes();
    const double read_s = bytes / (bw * 1e9);
    decode_rows.push_back({std::string(spec), 1 / per_tok, bytes / 1e6,
                           read_s * 1e3, per_tok / read_s});
  }
  std::printf(
      "\n| model | decode tok/s | weights MB | weight read ms | decode / read "
      "|\n|---|---|---|---|---|\n");
  for (const auto& r : decode_rows) {
    std::printf("| %s | %.1f | %.1f | %.2f | %.2fx |\n", r.model.c_str(),
                r.tok_s, r.weight_mb, r.read_ms, r.x_read);
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
