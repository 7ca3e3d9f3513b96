#ifndef SPECSERVE_COMMON_SERVICE_JSON_MASK_H_
#define SPECSERVE_COMMON_SERVICE_JSON_MASK_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "common/decoding/json_grammar.h"
#include "common/tokenizer/tokenizer.h"

namespace specserve {

/// A service's JsonTokenMask, built from its tokenizer on first use (a
/// 128K vocabulary takes ~0.4 s, which only JSON-mode requests should
/// pay). Thread-safe.
class LazyJsonTokenMask {
 public:
  /// `tokenizer` may be null (no JSON mode) and must outlive this object.
  LazyJsonTokenMask(const Tokenizer* tokenizer, std::vector<int> eos_ids)
      : tokenizer_(tokenizer), eos_ids_(std::move(eos_ids)) {}
  /// The mask; null without a tokenizer or if its table cannot be built
  /// (logged once).
  const JsonTokenMask* Get();

 private:
  const Tokenizer* const tokenizer_;
  const std::vector<int> eos_ids_;
  absl::once_flag once_;
  std::unique_ptr<JsonTokenMask> mask_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_JSON_MASK_H_
