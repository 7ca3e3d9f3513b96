// Generates text with one model, exactly as the target service would: the
// prompt (text, or token ids with optional non-contiguous position ids from
// Speculative Prefill and the original length as --next_position) is
// prefilled, then tokens are decoded one per step at next_position + i.
//
//   bazel run //tools:generate -- --model models/stories260K
//     --prompt "Once upon a time" --max_new_tokens 64 [--json]
//   bazel run //tools:generate -- --model models/stories260K
//     --token_ids 1,403,407 --position_ids 0,5,9 --next_position 12
//     --max_new_tokens 16 --json

#include <cstdio>
#include <numeric>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner_factory.h"
#include "common/service/runner_flags.h"
#include "common/speculation/target_session.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/cli.h"
#include "common/util/parse.h"
#include "common/util/paths.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "model directory (HF layout)");
ABSL_FLAG(std::string, prompt, "", "prompt text (BOS is prepended)");
ABSL_FLAG(std::string, token_ids, "", "prompt token ids instead of --prompt");
ABSL_FLAG(std::string, position_ids, "",
          "position ids of --token_ids (default 0..n-1); strictly increasing");
ABSL_FLAG(int, next_position, -1,
          "position of the first generated token (original prompt length); "
          "default last position + 1");
ABSL_FLAG(int, max_new_tokens, 64, "tokens to generate at most");
ABSL_FLAG(double, temperature, 0.0, "0 = greedy");
ABSL_FLAG(int, top_k, 0, "0 = off");
ABSL_FLAG(double, top_p, 1.0, "nucleus mass; 1 = off");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");
ABSL_FLAG(std::string, stop_token_ids, "", "extra stop token ids");
ABSL_FLAG(bool, ignore_eos, false, "do not stop at the model's EOS");
ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(int, threads, 0, "GEMM threads (0 = library default)");

namespace specserve {
namespace {

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  const std::string dir = ResolveUserPath(absl::GetFlag(FLAGS_model));
  auto tokenizer = LoadTokenizer(dir);
  if (!tokenizer.ok()) return ReportCliError(tokenizer.status());
  TargetRequest req;
  if (!absl::GetFlag(FLAGS_token_ids).empty()) {
    auto ids = ParseIntList(absl::GetFlag(FLAGS_token_ids), "--token_ids");
    if (!ids.ok()) return ReportCliError(ids.status());
    req.token_ids = *ids;
  } else if (!absl::GetFlag(FLAGS_prompt).empty()) {
    auto ids = (*tokenizer)->Encode(absl::GetFlag(FLAGS_prompt), true);
    if (!ids.ok()) return ReportCliError(ids.status());
    req.token_ids = *ids;
  } else {
    return ReportCliError(absl::InvalidArgumentError("--prompt or --token_ids is required"));
  }
  auto pos = ParseIntList(absl::GetFlag(FLAGS_position_ids), "--position_ids");
  if (!pos.ok()) return ReportCliError(pos.status());
  req.position_ids = *pos;
  if (req.position_ids.empty()) {
    req.position_ids.resize(req.token_ids.size());
    std::iota(req.position_ids.begin(), req.position_ids.end(), 0);
  }
  req.next_position = absl::GetFlag(FLAGS_next_position);
  req.sampling.temperature = absl::GetFlag(FLAGS_temperature);
  req.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  req.sampling.top_p = absl::GetFlag(FLAGS_top_p);
  req.sampling.seed = absl::GetFlag(FLAGS_seed);
  req.stop.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  auto stops = ParseIntList(absl::GetFlag(FLAGS_stop_token_ids), "--stop_token_ids");
  if (!stops.ok()) return ReportCliError(stops.status());
  req.stop.stop_token_ids = *stops;
  req.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  req.max_drafts = 0;

  auto runner = LoadModelRunner(dir, RunnerOptionsFromFlags());
  if (!runner.ok()) return ReportCliError(runner.status());
  ModelRunner& model = **runner;
  const std::vector<int> prompt_ids = req.token_ids;
  auto session = TargetSession::Create(&model, std::move(req));
  if (!session.ok()) return ReportCliError(session.status());

  double prefill_s = 0, decode_s = 0;
  int decode_tokens = 0;
  bool first = true;
  while (!(*session)->finished()) {
    auto round = (*session)->Step({});
    if (!round.ok()) return ReportCliError(round.status());
    const double s = round->forward_ns * 1e-9;
    if (first) {
      prefill_s = s;
      first = false;
    } else {
      decode_s += s;
      decode_tokens += static_cast<int>(round->tokens.size());
    }
  }
  const std::vector<int>& out = (*session)->output();
  auto text = (*tokenizer)->Decode(out);
  if (!text.ok()) return ReportCliError(text.status());
  const double tps = decode_s > 0 ? decode_tokens / decode_s : 0;
  const std::string finish(FinishReasonName((*session)->finish_reason()));
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j;
    j["text"] = *text;
    j["token_ids"] = out;
    j["prompt_tokens"] = prompt_ids.size();
    j["finish_reason"] = finish;
    j["prefill_s"] = prefill_s;
    j["decode_tokens_per_s"] = tps;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s\n", text->c_str());
    std::fprintf(stderr,
                 "prompt %zu tokens, generated %zu (%s); prefill %.4f s, "
                 "decode %.1f tokens/s\n",
                 prompt_ids.size(), out.size(), finish.c_str(), prefill_s, tps);
  }
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
