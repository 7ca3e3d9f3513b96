// Fuzz target: safetensors parsing (SafetensorsFile::FromBytes) and every
// read of the tensors it accepts. Any input must give OK or an error
// status; accepted tensors must lie inside the file and convert without
// reading out of bounds. Seeds: common/model/testdata/fuzz/safetensors.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = specserve::SafetensorsFile::FromBytes(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) return 0;
  for (const specserve::TensorInfo& t : (*file)->tensors()) {
    if (t.begin > t.end) std::abort();
    const auto raw = (*file)->RawBytes(t);
    if (raw.size() != t.num_bytes()) std::abort();
    // Bounded: a valid header may describe a huge tensor of zero-size dims.
    if (t.num_elements() > (1 << 20)) continue;
    std::vector<float> out;
    const absl::Status s =
        specserve::ReadTensorAsFloat(**file, t.name, t.shape, &out);
    if (s.ok() && static_cast<int64_t>(out.size()) != t.num_elements()) {
      std::abort();
    }
  }
  return 0;
}
