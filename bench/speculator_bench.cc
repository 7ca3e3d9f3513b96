// Speculator scoring latency vs prompt length, split into the full-prompt
// prefill, the look-ahead decode steps and the scoring itself (importance
// reduction + selection, everything after the forwards). Scoring must stay
// under 10% of the prefill.
//
//   bazel run -c opt //bench:speculator_bench [-- --models=... --lengths=...]
//
// Synthetic presets are run past their native context (RoPE extrapolates;
// speed does not depend on it) so that every shape covers 512..8192.

#include <cstdio>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/engine/cpu_model_runner.h"
#include "common/speculation/draft_session.h"

ABSL_FLAG(std::string, models,
          "stories260K-draft,synthetic:llama2-15m,synthetic:llama-3.2-1b",
          "bundled model names or synthetic:<preset>");
ABSL_FLAG(std::string, lengths, "128,512,1024,2048,4096,8192",
          "prompt lengths (tokens); lengths past a bundled model's context "
          "are skipped");
ABSL_FLAG(int, look_ahead, 8, "look-ahead tokens");
ABSL_FLAG(int, threads, 2, "threads (GEMMs and the importance reduction)");

namespace specserve {
namespace bench {
namespace {

int Run() {
  const int threads = absl::GetFlag(FLAGS_threads);
  SetEngineThreads(threads);
  std::printf("OpenBLAS core: %s, threads: %d, look-ahead %d, keep 0.3, "
              "chunk 32, pool 13\n\n",
              OpenBlasCoreName().c_str(), threads, absl::GetFlag(FLAGS_look_ahead));
  std::printf("| model | prompt | prefill ms | look-ahead ms | scoring ms | "
              "scoring / prefill | kept |\n|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(0);
  for (auto spec_view : absl::StrSplit(absl::GetFlag(FLAGS_models), ',')) {
    const std::string spec(spec_view);
    auto loaded = LoadBenchModel(spec);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s: %s\n", spec.c_str(),
                   loaded.status().ToString().c_str());
      return 1;
    }
    auto weights = std::make_shared<ModelWeights>(**loaded);
    loaded->reset();
    const bool synthetic = spec.rfind("synthetic:", 0) == 0;
    if (synthetic) weights->config.max_position_embeddings = 1 << 14;
    auto runner = CpuModelRunner::CreateForSequences(weights, 1);
    if (!runner.ok()) {
      std::fprintf(stderr, "%s\n", runner.status().ToString().c_str());
      return 1;
    }
    ModelRunner& model = **runner;
    const ModelConfig& c = model.config();
    for (auto len_view : absl::StrSplit(absl::GetFlag(FLAGS_lengths), ',')) {
      const int n = std::stoi(std::string(len_view));
      if (n + absl::GetFlag(FLAGS_look_ahead) > c.max_position_embeddings) {
        continue;
      }
      std::vector<int> prompt(n);
      for (int& t : prompt) t = 3 + rng() % (c.vocab_size - 3);
      prompt[0] = c.bos_token_id;
      auto session = DraftSession::Create(
          &model, n + absl::GetFlag(FLAGS_look_ahead) + 1, SamplingParams{});
      if (!session.ok()) return 1;
      ScoreOptions opt;
      opt.look_ahead = absl::GetFlag(FLAGS_look_ahead);
      opt.num_threads = threads;
      auto r = (*session)->Score(prompt, opt);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      std::printf("| %s | %d | %.1f | %.1f | %.2f | %.2f%% | %zu |\n",
                  spec.c_str(), n, r->prefill_ns / 1e6, r->look_ahead_ns / 1e6,
                  r->score_ns / 1e6, 100.0 * r->score_ns / r->prefill_ns,
                  r->selection.kept_indices.size());
      std::fflush(stdout);
    }
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
