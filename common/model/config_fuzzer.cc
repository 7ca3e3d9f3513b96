// Fuzz target: config.json parsing (ParseModelConfig). Any input must give
// OK or an error status, and an OK config must satisfy the invariants the
// engine relies on. Seeds: common/model/testdata/fuzz/config.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <cmath>

#include "common/model/config.h"
#include "common/model/rope.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<specserve::ModelConfig> c =
      specserve::ParseModelConfig(text);
  if (c.ok()) {
    if (c->hidden_size <= 0 || c->num_hidden_layers <= 0 ||
        c->num_attention_heads <= 0 || c->num_key_value_heads <= 0 ||
        c->num_attention_heads % c->num_key_value_heads != 0 ||
        c->vocab_size <= 0 || c->max_position_embeddings <= 0 ||
        c->head_dim <= 0) {
      std::abort();  // accepted a config the engine cannot run
    }
    // RoPE frequencies finite and non-negative, the factor positive.
    const specserve::RopeFrequencies rope =
        specserve::ComputeRopeFrequencies(*c);
    if (static_cast<int>(rope.inv_freq.size()) != c->head_dim / 2 ||
        !(rope.attention_factor > 0.0) ||
        !std::isfinite(rope.attention_factor)) {
      std::abort();
    }
    for (double f : rope.inv_freq) {
      if (!(f >= 0.0) || !std::isfinite(f)) std::abort();
    }
  }
  return 0;
}
