// Prints next-token logits of a model for given token ids at given position
// ids, as JSON:
//   {"rows":[{"row":2,"top":[[id,logit],...],"logsumexp":x,
//             "logits":{"5":x,...}}]}
// Example:
//   bazel run //tools:logits -- --model models/stories260K
//     --token_ids 1,5,9 --position_ids 0,1,4 --rows all --top_k 10 --ids 5,17

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner_factory.h"
#include "common/service/runner_flags.h"
#include "common/util/cli.h"
#include "common/util/parse.h"
#include "common/util/paths.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "model directory (HF layout)");
ABSL_FLAG(std::string, token_ids, "", "comma-separated token ids");
ABSL_FLAG(std::string, position_ids, "",
          "comma-separated position ids (default 0..n-1)");
ABSL_FLAG(std::string, rows, "last", "last | all | comma-separated rows");
ABSL_FLAG(int, top_k, 10, "how many top logits to print per row");
ABSL_FLAG(std::string, ids, "", "ids whose logits to print per row");
ABSL_FLAG(int, threads, 0, "GEMM threads (0 = library default)");

namespace specserve {
namespace {

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  auto ids = ParseIntList(absl::GetFlag(FLAGS_token_ids), "--token_ids");
  if (!ids.ok()) return ReportCliError(ids.status());
  if (ids->empty()) return ReportCliError(absl::InvalidArgumentError("--token_ids is required"));
  auto pos = ParseIntList(absl::GetFlag(FLAGS_position_ids), "--position_ids");
  if (!pos.ok()) return ReportCliError(pos.status());
  if (pos->empty()) {
    pos->resize(ids->size());
    std::iota(pos->begin(), pos->end(), 0);
  }
  auto extra = ParseIntList(absl::GetFlag(FLAGS_ids), "--ids");
  if (!extra.ok()) return ReportCliError(extra.status());
  auto runner = LoadModelRunner(ResolveUserPath(absl::GetFlag(FLAGS_model)),
                                RunnerOptionsFromFlags());
  if (!runner.ok()) return ReportCliError(runner.status());
  ModelRunner& model = **runner;
  const int vocab = model.config().vocab_size;
  const int n = static_cast<int>(ids->size());

  ForwardInput in;
  in.token_ids = *ids;
  in.position_ids = *pos;
  const std::string rows = absl::GetFlag(FLAGS_rows);
  if (rows == "all") {
    in.logit_rows.resize(n);
    std::iota(in.logit_rows.begin(), in.logit_rows.end(), 0);
  } else if (rows != "last") {
    auto r = ParseIntList(rows, "--rows");
    if (!r.ok()) return ReportCliError(r.status());
    in.logit_rows = *r;
  }
  for (int id : *extra) {
    if (id < 0 || id >= vocab) {
      return ReportCliError(absl::InvalidArgumentError("--ids: id outside the vocabulary"));
    }
  }
  auto cache = model.NewSequence(std::max(1, n));
  if (!cache.ok()) return ReportCliError(cache.status());
  ForwardOutput out;
  if (auto s = model.Forward(in, cache->get(), &out); !s.ok()) return ReportCliError(s);

  nlohmann::json result;
  result["rows"] = nlohmann::json::array();
  const int k = std::clamp(absl::GetFlag(FLAGS_top_k), 0, vocab);
  for (size_t j = 0; j < out.logit_rows.size(); ++j) {
    const float* lg = out.logits_row(j, vocab);
    std::vector<int> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int b) { return lg[a] > lg[b]; });
    nlohmann::json row;
    row["row"] = out.logit_rows[j];
    row["top"] = nlohmann::json::array();
    for (int t = 0; t < k; ++t) row["top"].push_back({order[t], lg[order[t]]});
    double m = *std::max_element(lg, lg + vocab), s = 0;
    for (int v = 0; v < vocab; ++v) s += std::exp(lg[v] - m);
    row["logsumexp"] = m + std::log(s);
    row["logits"] = nlohmann::json::object();
    for (int id : *extra) row["logits"][std::to_string(id)] = lg[id];
    result["rows"].push_back(row);
  }
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
