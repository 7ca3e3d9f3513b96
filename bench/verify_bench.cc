// Host cost of sampled speculative verification: VerifyDrafts (rows
// decided one after another) against the row-parallel form the target
// serves with (SampleRow per row up to the first rejection, as
// SampleOnHost runs it, then VerifyDraftsFromRows), on random logits of a
// Llama-3-sized vocabulary, for the sampling settings users pick.
//
//   bazel run -c opt //bench:verify_bench [-- --vocab=128256 --k=4]

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/bench_util.h"
#include "common/decoding/row_sampling.h"
#include "common/decoding/sampling.h"
#include "common/decoding/verification.h"

ABSL_FLAG(int, vocab, 128256, "vocabulary size");
ABSL_FLAG(int, k, 4, "drafts per round");
ABSL_FLAG(int, rounds, 50, "rounds timed per setting");

namespace specserve {
namespace bench {
namespace {

int Main() {
  const int vocab = absl::GetFlag(FLAGS_vocab);
  const int k = absl::GetFlag(FLAGS_k);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.f, 3.f);
  // Target rows, and draft logits = target + noise (some drafts accepted).
  std::vector<float> rows(static_cast<size_t>(k + 1) * vocab);
  for (float& x : rows) x = normal(gen);
  // Both forms compute the rows up to the first rejection (accepted + 1),
  // and their draws differ, so the time is per row computed.
  std::printf("vocab %d, k %d, %d rounds each; ms per row computed\n", vocab,
              k, rounds);
  std::printf("%-28s %12s %12s %17s\n", "sampling", "VerifyDrafts",
              "row form", "accepted / round");
  struct Setting {
    const char* name;
    SamplingParams params;
  };
  for (const Setting& s : {Setting{"T=1 (full support)", {1.f, 0, 1.f, 0}},
                           Setting{"T=0.7, top_p=0.9", {0.7f, 0, 0.9f, 0}},
                           Setting{"T=0.7, top_k=50", {0.7f, 50, 1.f, 0}}}) {
    std::vector<DraftToken> drafts(k);
    Rng draft_rng(2);
    for (int j = 0; j < k; ++j) {
      std::vector<float> q(rows.begin() + static_cast<size_t>(j) * vocab,
                           rows.begin() + static_cast<size_t>(j + 1) * vocab);
      for (float& x : q) x += 0.5f * normal(gen);
      drafts[j].q = ComputeDistribution(q, s.params);
      drafts[j].id = SampleFrom(drafts[j].q, &draft_rng);
    }
    Rng rng(3);
    int accepted_seq = 0, accepted_rows = 0;
    const double t0 = Now();
    for (int r = 0; r < rounds; ++r) {
      accepted_seq +=
          VerifyDrafts(drafts, rows, vocab, s.params, &rng)->num_accepted;
    }
    const double t1 = Now();
    for (int r = 0; r < rounds; ++r) {
      std::vector<int> sampled(k + 1, -1);
      std::vector<uint8_t> accepted(k + 1, 0);
      for (int j = 0; j <= k; ++j) {
        const double ua = rng.Uniform(), us = rng.Uniform();
        const RowSample row = SampleRow(
            absl::MakeConstSpan(rows).subspan(static_cast<size_t>(j) * vocab,
                                              vocab),
            s.params, j < k ? drafts[j].id : -1,
            j < k ? drafts[j].q : SparseDist{}, ua, us);
        sampled[j] = row.token;
        accepted[j] = row.accepted;
        if (!row.accepted) break;
      }
      accepted_rows +=
          VerifyDraftsFromRows(drafts, sampled, accepted, vocab)->num_accepted;
    }
    const double t2 = Now();
    std::printf("%-28s %12.3f %12.3f %8.2f /%5.2f\n", s.name,
                1e3 * (t1 - t0) / (accepted_seq + rounds),
                1e3 * (t2 - t1) / (accepted_rows + rounds),
                double(accepted_seq) / rounds, double(accepted_rows) / rounds);
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace specserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specserve::bench::Main();
}
