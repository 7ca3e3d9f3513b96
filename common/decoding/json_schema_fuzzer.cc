// Fuzz target: JSON Schema compilation and the matcher it drives, the part
// of structured output that reads a client's schema. Input: the schema
// text, a NUL byte, then bytes fed to a JsonMatcher of the compiled schema.
// Compile must answer OK or INVALID_ARGUMENT; a compiled schema's matcher
// takes any byte without crashing, its Key() is stable for a copy, a byte
// it rejects leaves it unchanged, and a complete object parses as JSON.
// Seeds: common/decoding/testdata/fuzz/json_schema.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "common/decoding/json_grammar.h"
#include "common/decoding/json_schema.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  const std::string schema_text = input.substr(0, split);
  const std::string bytes =
      split == std::string::npos ? "" : input.substr(split + 1);
  auto schema = specserve::JsonSchema::Compile(schema_text);
  if (!schema.ok()) {
    if (!absl::IsInvalidArgument(schema.status())) std::abort();
    return 0;
  }
  specserve::JsonMatcher m(schema->get());
  std::string accepted;
  for (const char c : bytes) {
    const std::string before = m.Key();
    if (m.Advance(static_cast<unsigned char>(c))) {
      accepted.push_back(c);
    } else if (m.Key() != before) {
      std::abort();  // a rejected byte changed the state
    }
    const specserve::JsonMatcher copy = m;
    if (copy.Key() != m.Key()) std::abort();
  }
  if (m.complete()) {
    const nlohmann::json v = nlohmann::json::parse(accepted, nullptr, false);
    // Exponents past double's range are valid JSON nlohmann refuses.
    if (v.is_discarded() &&
        accepted.find_first_of("eE") == std::string::npos) {
      std::abort();
    }
    if (!v.is_discarded() && !v.is_object()) std::abort();
  }
  return 0;
}
