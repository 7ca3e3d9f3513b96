#include "common/model/generation_config.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;

bool ReadId(const Json& v, int* id) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return false;
    }
    *id = static_cast<int>(u);
    return true;
  }
  const int64_t s = v.get<int64_t>();
  if (s < 0 || s > std::numeric_limits<int>::max()) return false;
  *id = static_cast<int>(s);
  return true;
}

}  // namespace

absl::Status ApplyGenerationConfig(std::string_view json_text,
                                   ModelConfig* config) {
  const Json j = Json::parse(json_text.begin(), json_text.end(), nullptr,
                             /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        "generation_config.json: not a JSON object");
  }
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  std::vector<int> ids;
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "generation_config.json: 'eos_token_id' must be a non-negative "
        "integer or a list of them, got ",
        it->dump()));
  };
  if (it->is_array()) {
    for (const Json& v : *it) {
      int id;
      if (!ReadId(v, &id)) return bad();
      ids.push_back(id);
    }
  } else {
    int id;
    if (!ReadId(*it, &id)) return bad();
    ids.push_back(id);
  }
  std::vector<int>& eos = config->eos_token_ids;
  for (int id : ids) {
    if (std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
  }
  return absl::OkStatus();
}

absl::Status ApplyGenerationConfigFile(const std::string& model_dir,
                                       ModelConfig* config) {
  const std::string path = absl::StrCat(model_dir, "/generation_config.json");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  absl::Status s = ApplyGenerationConfig(buf.str(), config);
  if (!s.ok()) {
    // The message starts with "generation_config.json: ".
    return absl::Status(s.code(), absl::StrCat(model_dir, "/", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace specserve
