#include "router/prompt_limits.h"

#include <algorithm>
#include <string>

#include "common/tokenizer/tokenizer.h"

namespace specserve {

int MaxBytesPerToken(const Tokenizer& tokenizer) {
  size_t longest = 1;
  for (int id = 0; id < tokenizer.vocab_size(); ++id) {
    if (auto text = tokenizer.Decode({id}); text.ok()) {
      longest = std::max(longest, text->size());
    }
    if (auto piece = tokenizer.IdToPiece(id); piece.ok()) {
      longest = std::max(longest, piece->size());
    }
  }
  return static_cast<int>(longest) + 1;
}

int64_t MaxPromptBytes(int max_context, int max_bytes_per_token) {
  if (max_context <= 0 || max_bytes_per_token <= 0) return 0;
  constexpr int64_t kNormalizationSlack = 3;
  return int64_t{max_context} * max_bytes_per_token * kNormalizationSlack;
}

}  // namespace specserve
