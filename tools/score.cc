// Speculative Prefill scoring of one prompt, in process (no server): the
// same DraftSession::Score and request validation the speculator service
// uses. Prints one JSON line:
//   {"kept_indices":[...],"position_ids":[...],"next_position":n,
//    "look_ahead_token_ids":[...],"importance":[...]}
// ("importance" only with --print_importance). Example:
//   bazel run //tools:score -- --model models/stories260K-draft
//     --prompt "Once upon a time" --keep_ratio 0.3 --chunk_size 32
//     --pool_kernel_size 13 --look_ahead 8 [--keep_first 1 --keep_last 1]
// Exit status 2 for bad input (message on stderr), 1 for other failures.

#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner_factory.h"
#include "common/service/runner_flags.h"
#include "common/model/weights.h"
#include "common/speculation/draft_session.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/cli.h"
#include "common/util/parse.h"
#include "common/util/paths.h"
#include "nlohmann/json.hpp"
#include "common/service/wire_options.h"

ABSL_FLAG(std::string, model, "", "speculator model directory (HF layout)");
ABSL_FLAG(std::string, prompt, "", "prompt text (tokenized with BOS)");
ABSL_FLAG(std::string, token_ids, "", "comma-separated prompt token ids");
ABSL_FLAG(double, keep_ratio, 0.3, "fraction of chunks kept, (0, 1]");
ABSL_FLAG(int, chunk_size, 32, "selection chunk size, >= 1");
ABSL_FLAG(int, pool_kernel_size, 13, "avg-pool kernel, odd >= 1");
ABSL_FLAG(int, look_ahead, 8, "greedy look-ahead tokens, [0, 64]");
ABSL_FLAG(int, keep_first, 1, "always keep the first k tokens");
ABSL_FLAG(int, keep_last, 1, "always keep the last k tokens");
ABSL_FLAG(int, min_prompt_tokens, 0, "shorter prompts are not pruned");
ABSL_FLAG(bool, print_importance, false, "also print per-token importance");
ABSL_FLAG(int, threads, 1, "GEMM and scoring threads");

namespace specserve {
namespace {

int Run() {
  const std::string model_flag = absl::GetFlag(FLAGS_model);
  const std::string text = absl::GetFlag(FLAGS_prompt);
  const std::string ids_flag = absl::GetFlag(FLAGS_token_ids);
  if (model_flag.empty()) {
    return ReportCliError(absl::InvalidArgumentError("--model is required"));
  }
  if (text.empty() == ids_flag.empty()) {
    return ReportCliError(absl::InvalidArgumentError(
        "exactly one of --prompt and --token_ids is required"));
  }
  v1::SpecPrefillOptions wire;
  wire.set_keep_ratio(static_cast<float>(absl::GetFlag(FLAGS_keep_ratio)));
  wire.set_chunk_size(absl::GetFlag(FLAGS_chunk_size));
  wire.set_pool_kernel_size(absl::GetFlag(FLAGS_pool_kernel_size));
  wire.set_look_ahead(absl::GetFlag(FLAGS_look_ahead));
  wire.set_keep_first(absl::GetFlag(FLAGS_keep_first));
  wire.set_keep_last(absl::GetFlag(FLAGS_keep_last));
  wire.set_min_prompt_tokens(absl::GetFlag(FLAGS_min_prompt_tokens));
  // Every field is set, so the defaults are unused; flags are named as typed.
  auto opts = ResolveScoreOptions(wire, SpecPrefillDefaults{},
                                  std::numeric_limits<int>::max(), "--");
  if (!opts.ok()) return ReportCliError(opts.status());
  opts->num_threads = absl::GetFlag(FLAGS_threads);

  const std::string dir = ResolveUserPath(model_flag);
  std::vector<int> prompt;
  if (!ids_flag.empty()) {
    auto ids = ParseIntList(ids_flag, "--token_ids");
    if (!ids.ok()) return ReportCliError(ids.status());
    prompt = *std::move(ids);
  } else {
    auto tok = LoadTokenizer(dir);
    if (!tok.ok()) return ReportCliError(tok.status());
    auto ids = (*tok)->Encode(text, /*add_bos=*/true);
    if (!ids.ok()) return ReportCliError(ids.status());
    prompt = *std::move(ids);
  }
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  auto runner = LoadModelRunner(dir, RunnerOptionsFromFlags());
  if (!runner.ok()) return ReportCliError(runner.status());
  ModelRunner& model = **runner;
  const ModelConfig& config = model.config();
  if (absl::Status s =
          ValidatePrompt(prompt, opts->look_ahead, config,
                         ids_flag.empty() ? "--prompt tokens" : "--token_ids");
      !s.ok()) {
    return ReportCliError(s);
  }
  auto session = DraftSession::Create(
      &model, static_cast<int>(prompt.size()) + opts->look_ahead,
      SamplingParams{});
  if (!session.ok()) return ReportCliError(session.status());
  auto r = (*session)->Score(prompt, *opts);
  if (!r.ok()) return ReportCliError(r.status());

  nlohmann::ordered_json out;
  out["kept_indices"] = r->selection.kept_indices;
  out["position_ids"] = r->selection.position_ids;
  out["next_position"] = r->selection.next_position;
  out["look_ahead_token_ids"] = r->look_ahead_tokens;
  if (absl::GetFlag(FLAGS_print_importance)) {
    out["importance"] = r->importance;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
