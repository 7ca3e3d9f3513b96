// Times Speculative Prefill's scoring step (ImportanceAccumulator::AddLayer)
// at Llama-3.2-1B shapes (32 heads, 8 kv heads, head_dim 64, 16 layers,
// 9 scoring rows = last prompt token + 8 look-ahead, the official
// look_ahead_cnt) and compares it with the FLOPs of the speculator's own
// full prefill at the same prompt length. The scoring must stay well under
// 10% of that prefill for Speculative Prefill to pay off.
//
// Usage: bazel run //bench:specprefill_scoring_bench --
//          [--threads=1,2] [--min_len=512] [--max_len=8192]
//          [--prefill_gflops=240] [--reps=3]
// --prefill_gflops is the throughput assumed for the prefill estimate; the
// default is llama.cpp's useful f32 prefill rate on the 2-core dev machine
// (measured on the anchor machine). Pass the engine's measured rate instead.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/specprefill/importance.h"

ABSL_FLAG(std::string, threads, "1,2",
          "comma-separated AddLayer thread counts");
ABSL_FLAG(int, min_len, 512, "smallest prompt length (doubles up to max_len)");
ABSL_FLAG(int, max_len, 8192, "largest prompt length");
ABSL_FLAG(int, rows, 9, "scoring rows (1 + look-ahead)");
ABSL_FLAG(int, pool_kernel, 13, "avg-pool kernel");
ABSL_FLAG(double, prefill_gflops, 240.0,
          "assumed prefill throughput (GFLOP/s) for the comparison column");
ABSL_FLAG(int, reps, 3, "timed repetitions (best is reported)");

namespace {

// Llama-3.2-1B (HF config.json).
constexpr int kHidden = 2048;
constexpr int kInter = 8192;
constexpr int kLayers = 16;
constexpr int kHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 64;
constexpr int kVocab = 128256;

// FLOPs of one full prefill of n tokens: 2 * (linear params) per token, the
// causal attention (QK^T and PV over n(n+1)/2 pairs per head), and the LM
// head for the last token only.
double PrefillFlops(int n) {
  const double per_layer_linear =
      static_cast<double>(kHidden) * kHeads * kHeadDim +  // q
      2.0 * kHidden * kKvHeads * kHeadDim +               // k, v
      static_cast<double>(kHeads) * kHeadDim * kHidden +  // o
      3.0 * kHidden * kInter;                             // mlp
  const double linear = 2.0 * per_layer_linear * kLayers * n;
  const double attention = kLayers * kHeads * 2.0 *
                           (static_cast<double>(n) * (n + 1) / 2.0) * 2.0 *
                           kHeadDim;
  const double lm_head = 2.0 * kHidden * kVocab;
  return linear + attention + lm_head;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> thread_counts;
  for (absl::string_view t :
       absl::StrSplit(absl::GetFlag(FLAGS_threads), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(t, &v) || v < 1) {
      std::fprintf(stderr, "bad --threads entry: %s\n", std::string(t).c_str());
      return 2;
    }
    thread_counts.push_back(v);
  }
  const int rows = absl::GetFlag(FLAGS_rows);
  const double prefill_gflops = absl::GetFlag(FLAGS_prefill_gflops);
  specserve::ScoringOptions opts;
  opts.pool_kernel_size = absl::GetFlag(FLAGS_pool_kernel);

  std::printf(
      "Speculative Prefill scoring, Llama-3.2-1B shapes: %d layers, %d heads, "
      "%d kv heads, head_dim %d, %d rows, pool %d\n",
      kLayers, kHeads, kKvHeads, kHeadDim, rows, opts.pool_kernel_size);
  std::printf("prefill estimate at %.0f GFLOP/s (--prefill_gflops)\n\n",
              prefill_gflops);
  std::printf("%7s %7s %10s %10s %10s %12s %14s %8s\n", "prompt", "threads",
              "ms/layer", "total_ms", "GFLOP/s", "prefill_TF", "prefill_ms",
              "ratio");

  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t stride = static_cast<size_t>(kKvHeads) * kHeadDim;
  for (int n = absl::GetFlag(FLAGS_min_len); n <= absl::GetFlag(FLAGS_max_len);
       n *= 2) {
    // Distinct memory per layer, like a real KV cache.
    std::vector<std::vector<float>> keys(kLayers);
    std::vector<std::vector<float>> queries(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      keys[l].resize(static_cast<size_t>(n) * stride);
      for (float& v : keys[l]) v = normal(rng);
      queries[l].resize(static_cast<size_t>(rows) * kHeads * kHeadDim);
      for (float& v : queries[l]) v = normal(rng);
    }
    const double score_flops =
        2.0 * rows * kHeads * static_cast<double>(n) * kHeadDim * kLayers;
    const double prefill_flops = PrefillFlops(n);
    const double prefill_ms = prefill_flops / (prefill_gflops * 1e9) * 1e3;
    for (int threads : thread_counts) {
      double best_ms = 1e30;
      for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
        specserve::ImportanceAccumulator acc(n, rows, kHeads, kKvHeads,
                                             kHeadDim, kLayers, opts);
        acc.set_num_threads(threads);
        const auto t0 = std::chrono::steady_clock::now();
        for (int l = 0; l < kLayers; ++l) {
          const absl::Status s =
              acc.AddLayer(l, queries[l].data(), keys[l].data(), stride);
          if (!s.ok()) {
            std::fprintf(stderr, "AddLayer: %s\n", s.ToString().c_str());
            return 1;
          }
        }
        const std::vector<float> importance = acc.Importance();
        const auto t1 = std::chrono::steady_clock::now();
        if (importance.size() != static_cast<size_t>(n)) return 1;
        best_ms = std::min(
            best_ms,
            std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      std::printf("%7d %7d %10.3f %10.2f %10.1f %12.2f %14.0f %7.3f%%\n", n,
                  threads, best_ms / kLayers, best_ms,
                  score_flops / (best_ms * 1e-3) / 1e9, prefill_flops / 1e12,
                  prefill_ms, 100.0 * best_ms / prefill_ms);
    }
  }
  return 0;
}
