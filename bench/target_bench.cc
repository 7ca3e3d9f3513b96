// Target prefill time vs kept fraction (Speculative Prefill prunes the
// prompt; the target prefills only the kept tokens at their original
// positions), and verify-round time vs the number of drafts k relative to a
// plain decode step.
//
//   bazel run -c opt //bench:target_bench [-- --models=... --lengths=...]

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/engine/cpu_model_runner.h"
#include "common/speculation/target_session.h"

ABSL_FLAG(std::string, models,
          "stories260K,synthetic:llama2-110m,synthetic:llama-3.2-1b",
          "bundled model names or synthetic:<preset>");
ABSL_FLAG(std::string, lengths, "512,2048", "original prompt lengths");
ABSL_FLAG(std::string, fractions, "0.1,0.3,0.5,0.7,1.0", "kept fractions");
ABSL_FLAG(std::string, ks, "0,2,4,8", "drafts per verify round");
ABSL_FLAG(int, rounds, 8, "verify rounds timed per k");
ABSL_FLAG(int, threads, 2, "GEMM threads");

namespace specserve {
namespace bench {
namespace {

std::vector<double> Doubles(const std::string& s) {
  std::vector<double> out;
  for (auto v : absl::StrSplit(s, ',')) out.push_back(std::stod(std::string(v)));
  return out;
}

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  std::printf("OpenBLAS core: %s, threads: %d\n\n", OpenBlasCoreName().c_str(),
              absl::GetFlag(FLAGS_threads));
  std::printf("| model | prompt | kept | prefill ms | speedup vs full |\n"
              "|---|---|---|---|---|\n");
  std::string verify_table =
      "| model | context | k | verify round ms | x decode step | "
      "ms per draft+1 |\n|---|---|---|---|---|---|\n";
  std::mt19937 rng(0);
  for (auto spec_view : absl::StrSplit(absl::GetFlag(FLAGS_models), ',')) {
    const std::string spec(spec_view);
    auto weights = LoadBenchModel(spec);
    if (!weights.ok()) {
      std::fprintf(stderr, "%s: %s\n", spec.c_str(),
                   weights.status().ToString().c_str());
      return 1;
    }
    // One session at a time, at most the model's context each.
    auto runner = CpuModelRunner::CreateForSequences(*weights, 1);
    if (!runner.ok()) {
      std::fprintf(stderr, "%s\n", runner.status().ToString().c_str());
      return 1;
    }
    ModelRunner& model = **runner;
    const ModelConfig& c = model.config();
    int last_n = -1;
    for (double len_d : Doubles(absl::GetFlag(FLAGS_lengths))) {
      // Bundled models have a 512-token context: cap the prompt so the
      // verify rounds still fit.
      const int n = std::min(static_cast<int>(len_d),
                             c.max_position_embeddings - 80);
      if (n <= 0 || n == last_n) continue;
      last_n = n;
      std::vector<int> prompt(n);
      for (int& t : prompt) t = 3 + rng() % (c.vocab_size - 3);
      double full_ms = 0;
      auto fractions = Doubles(absl::GetFlag(FLAGS_fractions));
      std::sort(fractions.rbegin(), fractions.rend());  // full first
      for (double f : fractions) {
        // Keep a spread of indices (like chunked selection) plus the last.
        const int kept = std::max(2, static_cast<int>(n * f + 0.5));
        TargetRequest req;
        for (int i = 0; i < kept; ++i) {
          const int idx = static_cast<int>(int64_t(i) * (n - 1) / (kept - 1));
          if (req.position_ids.empty() || idx > req.position_ids.back()) {
            req.position_ids.push_back(idx);
            req.token_ids.push_back(prompt[idx]);
          }
        }
        req.next_position = n;
        req.stop.max_new_tokens = 1;
        auto s = TargetSession::Create(&model, req);
        if (!s.ok()) return 1;
        auto round = (*s)->Step({});
        if (!round.ok()) return 1;
        const double ms = round->forward_ns / 1e6;
        if (f >= 1.0) full_ms = ms;
        std::printf("| %s | %d | %.0f%% (%zu) | %.1f | %s |\n", spec.c_str(), n,
                    100 * f, req.token_ids.size(), ms,
                    full_ms > 0 ? absl::StrFormat("%.2fx", full_ms / ms).c_str()
                                : "-");
        std::fflush(stdout);
      }
      // Verify rounds after a full prefill of n tokens.
      double decode_ms = 0;
      for (double kd : Doubles(absl::GetFlag(FLAGS_ks))) {
        const int k = static_cast<int>(kd);
        TargetRequest req;
        req.token_ids = prompt;
        req.position_ids.resize(n);
        std::iota(req.position_ids.begin(), req.position_ids.end(), 0);
        req.stop.max_new_tokens = absl::GetFlag(FLAGS_rounds) * (k + 1) + 2;
        req.ignore_eos = true;
        auto s = TargetSession::Create(&model, req);
        if (!s.ok() || !(*s)->Step({}).ok()) return 1;
        double total = 0;
        int rounds = 0;
        for (int r = 0; r < absl::GetFlag(FLAGS_rounds) && !(*s)->finished();
             ++r) {
          std::vector<DraftToken> drafts(k);
          for (auto& d : drafts) d.id = 3 + rng() % (c.vocab_size - 3);
          auto round = (*s)->Step(drafts);
          if (!round.ok()) return 1;
          total += round->forward_ns / 1e6;
          ++rounds;
        }
        const double ms = total / std::max(1, rounds);
        if (k == 0) decode_ms = ms;
        verify_table += absl::StrFormat(
            "| %s | %d | %d | %.2f | %.2fx | %.2f |\n", spec, n, k, ms,
            decode_ms > 0 ? ms / decode_ms : 0.0, ms / (k + 1));
      }
    }
  }
  std::printf("\n%s", verify_table.c_str());
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
