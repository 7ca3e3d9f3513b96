#include "bench/bench_util.h"

#include <cblas.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/engine/huge_page_arena.h"
#include "common/model/synthetic.h"

namespace specserve {
namespace bench {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<std::shared_ptr<const ModelWeights>> LoadBenchModel(
    const std::string& spec) {
  std::string dir;
  if (absl::StartsWith(spec, "synthetic:")) {
    const std::string preset = spec.substr(strlen("synthetic:"));
    const char* root = std::getenv("SPECSERVE_SYNTHETIC_DIR");
    dir = absl::StrCat(root ? root : "/tmp/specserve_synthetic", "/", preset);
    struct stat st;
    if (stat((dir + "/model.safetensors").c_str(), &st) != 0) {
      mkdir(root ? root : "/tmp/specserve_synthetic", 0755);
      if (auto s = WriteSyntheticCheckpoint(preset, dir, 0); !s.ok()) return s;
    }
  } else {
    dir = "models/" + spec;
  }
  auto w = LoadModelWeights(dir);
  if (!w.ok()) return w.status();
  return std::shared_ptr<const ModelWeights>(
      std::make_shared<ModelWeights>(*std::move(w)));
}

double SgemmGflops(int m, int n, int k, int reps) {
  std::vector<float> a(size_t(m) * k), b(size_t(n) * k), c(size_t(m) * n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : a) x = u(rng);
  for (auto& x : b) x = u(rng);
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    const double t0 = Now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f,
                a.data(), k, b.data(), k, 0.f, c.data(), n);
    const double t = Now() - t0;
    if (r > 0) best = std::min(best, t);
  }
  return 2.0 * m * n * k / best / 1e9;
}

double TriadGBps(int threads, int mib) {
  const size_t n = size_t(mib) * 1024 * 1024 / sizeof(float);
  // Huge pages, like the engine's weights and KV planes (HugePageArena):
  // the ceiling is measured on the memory the engine streams.
  HugePageArena& arena = HugePageArena::Default();
  std::shared_ptr<float[]> a = arena.AllocateArray<float>(n),
                           b = arena.AllocateArray<float>(n),
                           c = arena.AllocateArray<float>(n);
  auto run = [&](auto fn) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        fn(lo, hi);
      });
    }
    for (auto& t : ts) t.join();
  };
  run([&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) a[i] = 0, b[i] = 1, c[i] = 2;
  });
  double best = 1e30;
  for (int r = 0; r < 4; ++r) {
    const double t0 = Now();
    run([&](size_t lo, size_t hi) {
      float* __restrict pa = a.get();
      const float* __restrict pb = b.get();
      const float* __restrict pc = c.get();
      for (size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 3.f * pc[i];
    });
    const double t = Now() - t0;
    if (r > 0) best = std::min(best, t);
  }
  return 3.0 * n * sizeof(float) / best / 1e9;
}

double LayerFlopsPerToken(const ModelConfig& c) {
  const double h = c.hidden_size;
  const double per_layer =
      h * c.qkv_dim() + double(c.num_attention_heads) * c.head_dim * h +
      3.0 * h * c.intermediate_size;
  return 2.0 * per_layer * c.num_hidden_layers;
}

double AttentionFlops(const ModelConfig& c, int n) {
  // q.k and p.v over the causal triangle: 2 * 2 * n^2/2 * H * D per layer.
  return 2.0 * double(n) * n * c.num_attention_heads * c.head_dim *
         c.num_hidden_layers;
}

double ProcStatusBytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      return std::stod(line.substr(key.size() + 1)) * 1024;
    }
  }
  return 0;
}

}  // namespace bench
}  // namespace specserve
