#include "common/service/json_mask.h"

#include <cstdio>
#include <string>

#include "common/tokenizer/token_bytes.h"

namespace specserve {

const JsonTokenMask* LazyJsonTokenMask::Get() {
  absl::call_once(once_, [this] {
    if (tokenizer_ == nullptr) return;
    absl::StatusOr<TokenByteTable> table = BuildTokenByteTable(*tokenizer_);
    if (!table.ok()) {
      std::fprintf(stderr, "JSON mode unavailable: %s\n",
                   std::string(table.status().message()).c_str());
      return;
    }
    mask_ = std::make_unique<JsonTokenMask>(*std::move(table), eos_ids_);
  });
  return mask_.get();
}

}  // namespace specserve
