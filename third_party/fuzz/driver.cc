// A deterministic stand-in for libFuzzer's main(), linked into fuzz targets
// in the default (gcc) build so that `bazel test //...` replays every
// corpus and a fixed number of mutations of it; --config=fuzz links the
// real libFuzzer instead (third_party/fuzz/fuzz.bzl).
//
// Accepts libFuzzer's command line: directories or files are inputs,
// "-runs_if_no_libfuzzer=N" sets the mutation count (default 2000) and
// every other "-flag=value" is ignored. Mutations (seed 1): flip, insert,
// delete or overwrite bytes, copy a run inside the input, splice two
// inputs, and interesting values (0, 0xff, digits, quotes, brackets).
// Exit status 0; a crash is the failure, as under libFuzzer.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Run(const std::string& s) {
  // A copy in its own allocation, as libFuzzer does, so reads past the end
  // are out of bounds for sanitizers.
  std::vector<uint8_t> buf(s.begin(), s.end());
  LLVMFuzzerTestOneInput(buf.empty() ? nullptr : buf.data(), buf.size());
}

std::string Mutate(std::string s, const std::vector<std::string>& corpus,
                   std::mt19937_64& rng) {
  static const char kInteresting[] = "\0\xff\x7f\x80" "0123456789-.eE\"'[]{},:\\ ";
  auto pick = [&](size_t n) { return n == 0 ? 0 : rng() % n; };
  const int steps = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < steps; ++i) {
    switch (rng() % 7) {
      case 0:
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:
        s.insert(s.begin() + pick(s.size() + 1),
                 kInteresting[pick(sizeof(kInteresting) - 1)]);
        break;
      case 2:
        if (!s.empty()) {
          const size_t at = pick(s.size());
          s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
        }
        break;
      case 3:
        if (!s.empty()) {
          s[pick(s.size())] = kInteresting[pick(sizeof(kInteresting) - 1)];
        }
        break;
      case 4:
        if (!s.empty()) {
          const size_t from = pick(s.size());
          const size_t len = 1 + pick(std::min<size_t>(32, s.size() - from));
          s.insert(pick(s.size() + 1), s.substr(from, len));
        }
        break;
      case 5:
        if (!corpus.empty()) {
          const std::string& o = corpus[pick(corpus.size())];
          s = s.substr(0, pick(s.size() + 1)) + o.substr(pick(o.size() + 1));
        }
        break;
      case 6:
        if (!s.empty()) s.resize(pick(s.size()));
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  long runs = 2000;
  std::vector<std::string> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string kRuns = "-runs_if_no_libfuzzer=";
    if (a.rfind(kRuns, 0) == 0) {
      runs = std::strtol(a.c_str() + kRuns.size(), nullptr, 10);
      continue;
    }
    if (!a.empty() && a[0] == '-') continue;
    std::error_code ec;
    if (std::filesystem::is_directory(a, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(a, ec)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) corpus.push_back(ReadAll(f));
    } else {
      corpus.push_back(ReadAll(a));
    }
  }
  for (const std::string& s : corpus) Run(s);
  std::mt19937_64 rng(1);
  const std::string empty;
  for (long r = 0; r < runs; ++r) {
    const std::string& base =
        corpus.empty() ? empty : corpus[rng() % corpus.size()];
    Run(Mutate(base, corpus, rng));
  }
  std::printf("fuzz driver: %zu corpus inputs, %ld mutations, no crash\n",
              corpus.size(), runs);
  return 0;
}
