#include "common/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a LE host"
#endif

namespace specserve {
namespace {

using Json = nlohmann::json;

// Debian's Abseil is built with its own absl::string_view (not
// std::string_view), so StrCat and hash lookups need an explicit bridge.
absl::string_view AV(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// A valid header nests 3 deep ({name: {shape: [..]}}); anything much deeper
// is hostile.
constexpr int kMaxJsonDepth = 16;

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::kF32, "F32", 4},        {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},      {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},        {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},        {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},          {DType::kBool, "BOOL", 1},
    {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};

bool IsFloatWeightType(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Max bracket depth of JSON text outside strings.
int JsonDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

// A JSON non-negative integer as uint64 (floats, negatives, others: false).
bool GetUint(const Json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return true;
}

// Parses one tensor entry {dtype, shape, data_offsets} into `t`.
absl::Status ParseEntry(const std::string& file, const std::string& name,
                        const Json& v, uint64_t data_size, TensorInfo* t) {
  auto err = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": tensor '", AV(name), "': ", parts...));
  };
  if (!v.is_object()) return err("entry is not an object: ", v.dump());
  t->name = name;

  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) {
    return err("missing or non-string 'dtype'");
  }
  absl::StatusOr<DType> dtype = ParseDType(dt->get<std::string>());
  if (!dtype.ok()) {
    return err("unknown dtype '", dt->get<std::string>(), "'");
  }
  t->dtype = *dtype;

  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return err("missing 'shape' array");
  uint64_t elements = 1;
  for (const Json& d : *sh) {
    uint64_t dim;
    if (!GetUint(d, &dim) ||
        dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return err("shape ", sh->dump(), " must hold non-negative integers");
    }
    if (__builtin_mul_overflow(elements, dim, &elements) ||
        elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return err("shape ", sh->dump(), " overflows");
    }
    t->shape.push_back(static_cast<int64_t>(dim));
  }

  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 ||
      !GetUint((*off)[0], &t->begin) || !GetUint((*off)[1], &t->end)) {
    return err("'data_offsets' must be [begin, end] non-negative integers");
  }
  if (t->begin > t->end) {
    return err("data_offsets [", t->begin, ", ", t->end, "] have begin > end");
  }
  if (t->end > data_size) {
    return err("data_offsets [", t->begin, ", ", t->end,
               "] extend past the data buffer (", data_size, " bytes)");
  }
  uint64_t bytes;
  if (__builtin_mul_overflow(elements, DTypeSize(t->dtype), &bytes)) {
    return err("shape ", sh->dump(), " overflows");
  }
  if (bytes != t->end - t->begin) {
    return err("data_offsets [", t->begin, ", ", t->end, "] span ",
               t->end - t->begin, " bytes but ", AV(DTypeName(t->dtype)),
               " shape ", ShapeString(t->shape), " needs ", bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsHeader> ParseHeaderImpl(std::string_view bytes,
                                                  const std::string& file) {
  SafetensorsHeader h;
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": ", bytes.size(),
        " bytes is too short for the 8-byte safetensors header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  }
  if (n > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": header length ", n, " extends past the end of the file (",
        bytes.size(), " bytes)"));
  }
  if (n > kMaxSafetensorsHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length ", n,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderSize));
  }
  h.header_size = n;
  h.data_start = 8 + n;
  h.data_size = bytes.size() - h.data_start;
  std::string_view text = bytes.substr(8, n);
  if (JsonDepth(text) > kMaxJsonDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header JSON nests deeper than ", kMaxJsonDepth));
  }

  // nlohmann keeps the last of duplicate keys; a duplicate tensor name is
  // ambiguous, so catch it while parsing.
  std::set<std::string> seen;
  std::string duplicate;
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        duplicate.empty() && !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json j = Json::parse(text.begin(), text.end(), callback,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header is not valid JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header JSON is not an object"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": tensor '", duplicate, "' appears more than once"));
  }

  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": __metadata__ is not an object"));
      }
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              file, ": __metadata__ value for '", k, "' is not a string"));
        }
        h.metadata[k] = mv.get<std::string>();
      }
      continue;
    }
    TensorInfo t;
    absl::Status s = ParseEntry(file, name, v, h.data_size, &t);
    if (!s.ok()) return s;
    h.tensors.push_back(std::move(t));
  }
  std::sort(
      h.tensors.begin(), h.tensors.end(),
      [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });

  // Overlap check over the non-empty ranges, in offset order.
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : h.tensors) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) {
              return a->begin < b->begin;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo* a = by_offset[i - 1];
    const TensorInfo* b = by_offset[i];
    if (b->begin < a->end) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor '", b->name, "' data_offsets [",
                       b->begin, ", ", b->end, "] overlap tensor '", a->name,
                       "' [", a->begin, ", ", a->end, "]"));
    }
  }
  return h;
}

// Writes n values of `src` into `dst` in `dtype` (F32/F16/BF16).
void EncodeValues(const float* src, size_t n, DType dtype, uint8_t* dst) {
  // An empty tensor's data() may be null, and memcpy from null is undefined
  // even for 0 bytes (UBSan, --config=asan).
  if (n == 0) return;
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = FloatToHalf(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b = FloatToBFloat16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    default:
      return;  // rejected by BuildSafetensorsHeader
  }
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool IsValidUtf8(std::string_view s) {
  try {
    (void)Json(std::string(s)).dump();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::string JoinPath(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  if (dir.back() == '/') return dir + file;
  return dir + "/" + file;
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

size_t DTypeSize(DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return e.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown safetensors dtype '", AV(name), "'"));
}

int64_t TensorInfo::num_elements() const { return NumElements(shape); }

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    std::string_view file_bytes, std::string_view file_name) {
  try {
    return ParseHeaderImpl(file_bytes, std::string(file_name));
  } catch (const std::exception& e) {  // e.g. bad_alloc; never escapes
    return absl::InvalidArgumentError(
        absl::StrCat(AV(file_name), ": cannot parse header: ", e.what()));
  }
}

// ---------------------------------------------------------------------------
// fp16 / bf16

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(v) | sign);
  }
  if (exp == 31) {  // inf (mant 0) or NaN (payload kept)
    return BitsFloat(sign | 0x7f800000u | (mant << 13));
  }
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

float BFloat16ToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

uint16_t FloatToHalf(float f) {
  // Round to nearest even (F. Giesen's float_to_half_fast3_rtne).
  uint32_t x = FloatBits(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= (127u + 16u) << 23) {  // >= 65536, inf or NaN
    o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (x < (113u << 23)) {  // below 2^-14: subnormal or zero
    // Adding 0.5 * 2^(-14 + 1) ... aligns the mantissa so the FPU's own
    // round-to-nearest-even rounds at the half-precision subnormal ulp.
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float t = BitsFloat(x) + BitsFloat(magic);
    o = static_cast<uint16_t>(FloatBits(t) - magic);
  } else {
    const uint32_t mant_odd = (x >> 13) & 1;
    x += ((15u - 127u) << 23) + 0xfff;  // rebias exponent, round half up
    x += mant_odd;                      // ... ties to even
    o = static_cast<uint16_t>(x >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet NaN
    return static_cast<uint16_t>((x >> 16) | 0x40);
  }
  x += 0x7fffu + ((x >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

// ---------------------------------------------------------------------------
// SafetensorsFile

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(path, ": not found"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(
          absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    f->mapping_ = m;
    f->mapping_size_ = f->size_;
    f->bytes_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping keeps the file
  absl::Status s = f->Init(path);
  if (!s.ok()) return s;
  return f;
}

void SafetensorsFile::ReleasePages(const TensorInfo& info) const {
  if (mapping_ == nullptr) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin =
      reinterpret_cast<uintptr_t>(bytes_ + header_.data_start + info.begin);
  const uintptr_t end =
      reinterpret_cast<uintptr_t>(bytes_ + header_.data_start + info.end);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = end / page * page;
  if (last > first) {
    ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string bytes, std::string name) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->owned_ = std::move(bytes);
  f->bytes_ = reinterpret_cast<const uint8_t*>(f->owned_.data());
  f->size_ = f->owned_.size();
  absl::Status s = f->Init(name);
  if (!s.ok()) return s;
  return f;
}

absl::Status SafetensorsFile::Init(std::string_view path) {
  path_ = std::string(path);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(
      std::string_view(reinterpret_cast<const char*>(bytes_), size_), path_);
  if (!h.ok()) return h.status();
  header_ = *std::move(h);
  index_.reserve(header_.tensors.size());
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    index_.emplace(header_.tensors[i].name, i);
  }
  return absl::OkStatus();
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(AV(name));
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(header_.tensors.size());
  for (const TensorInfo& t : header_.tensors) out.push_back(t.name);
  return out;
}

absl::Span<const uint8_t> SafetensorsFile::RawBytes(
    const TensorInfo& info) const {
  // Offsets were validated against this file's buffer by Init.
  return absl::Span<const uint8_t>(bytes_ + header_.data_start + info.begin,
                                   info.end - info.begin);
}

absl::Status SafetensorsFile::CheckView(const TensorInfo& info, size_t size,
                                        size_t align) const {
  if (size != DTypeSize(info.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor '", info.name, "' has dtype ",
                     AV(DTypeName(info.dtype)), " (", DTypeSize(info.dtype),
                     " bytes), not viewable as ", size, "-byte elements"));
  }
  const uintptr_t p =
      reinterpret_cast<uintptr_t>(bytes_ + header_.data_start + info.begin);
  if (p % align != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '",
                                                   info.name, "' data is not ",
                                                   align, "-byte aligned"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Reading as fp32

absl::StatusOr<RawTensor> ViewTensor(const SafetensorsFile& file,
                                     std::string_view name,
                                     absl::Span<const int64_t> expected_shape) {
  const TensorInfo* t = file.Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(file.path(), ": tensor '", AV(name), "' not found"));
  }
  if (!std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": tensor '", AV(name), "' has shape ",
        ShapeString(t->shape), ", expected ", ShapeString(expected_shape)));
  }
  if (!IsFloatWeightType(t->dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", AV(name), "' has dtype ",
                     AV(DTypeName(t->dtype)),
                     "; only F32, F16 and BF16 can be read as weights"));
  }
  return RawTensor{file.RawBytes(*t), t->dtype};
}

void ConvertToFloat(const uint8_t* src, DType dtype, size_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(dst, src, n * sizeof(float));
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = BFloat16ToFloat(b);
      }
      break;
    default:
      break;  // callers pass weight types only (ViewTensor checks)
  }
}

absl::Status ReadTensorInto(const SafetensorsFile& file, std::string_view name,
                            absl::Span<const int64_t> expected_shape,
                            absl::Span<float> dst) {
  absl::StatusOr<RawTensor> t = ViewTensor(file, name, expected_shape);
  if (!t.ok()) return t.status();
  const size_t n = t->bytes.size() / DTypeSize(t->dtype);
  if (dst.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", AV(name), "' has ", n,
                     " elements but the destination holds ", dst.size()));
  }
  ConvertToFloat(t->bytes.data(), t->dtype, n, dst.data());
  return absl::OkStatus();
}

absl::Status ReadTensorAsFloat(const SafetensorsFile& file,
                               std::string_view name,
                               absl::Span<const int64_t> expected_shape,
                               std::vector<float>* out) {
  const TensorInfo* t = file.Find(name);
  // Size `out` from the stored shape only once it is known to match.
  if (t != nullptr &&
      std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(),
                 expected_shape.end())) {
    out->resize(static_cast<size_t>(t->num_elements()));
  }
  return ReadTensorInto(file, name, expected_shape, absl::MakeSpan(*out));
}

// ---------------------------------------------------------------------------
// Checkpoint

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(
    const std::string& model_dir) {
  std::unique_ptr<Checkpoint> c(new Checkpoint());
  c->dir_ = model_dir;
  const std::string single = JoinPath(model_dir, "model.safetensors");
  const std::string index = JoinPath(model_dir, "model.safetensors.index.json");

  if (FileExists(single)) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
        SafetensorsFile::Open(single);
    if (!f.ok()) return f.status();
    c->source_ = single;
    for (size_t i = 0; i < (*f)->tensors().size(); ++i) {
      c->where_.emplace((*f)->tensors()[i].name, 0);
    }
    c->files_.push_back(*std::move(f));
    return c;
  }
  if (!FileExists(index)) {
    return absl::NotFoundError(absl::StrCat(
        model_dir,
        ": neither model.safetensors nor model.safetensors.index.json found"));
  }
  c->source_ = index;

  std::ifstream in(index, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(index, ": cannot read"));
  }
  const std::string text = buf.str();
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index, ": not a valid JSON object"));
  }
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index, ": missing 'weight_map' object"));
  }
  std::map<std::string, size_t> shard_index;  // shard file -> files_[i]
  std::vector<std::pair<std::string, std::string>> entries;
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          index, ": weight_map entry for '", name, "' is not a string"));
    }
    std::string file = shard.get<std::string>();
    // Shards live beside the index; refuse paths that leave the directory.
    if (file.empty() || file == "." || file == ".." ||
        file.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": weight_map maps '", name,
                       "' to invalid shard name '", file, "'"));
    }
    shard_index.emplace(file, 0);
    entries.emplace_back(name, std::move(file));
  }
  for (auto& [file, i] : shard_index) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
        SafetensorsFile::Open(JoinPath(model_dir, file));
    if (!f.ok()) return f.status();
    i = c->files_.size();
    c->files_.push_back(*std::move(f));
  }
  for (const auto& [name, file] : entries) {
    const size_t i = shard_index[file];
    if (c->files_[i]->Find(name) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": weight_map maps '", name, "' to '", file,
                       "', which has no such tensor"));
    }
    c->where_.emplace(name, i);
  }
  return c;
}

void Checkpoint::ReleaseTensor(std::string_view name) const {
  const SafetensorsFile* f = FileFor(name);
  if (f == nullptr) return;
  const TensorInfo* info = f->Find(name);
  if (info != nullptr) f->ReleasePages(*info);
}

const SafetensorsFile* Checkpoint::FileFor(std::string_view name) const {
  auto it = where_.find(AV(name));
  return it == where_.end() ? nullptr : files_[it->second].get();
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  const SafetensorsFile* f = FileFor(name);
  return f == nullptr ? nullptr : f->Find(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, i] : where_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status Checkpoint::ReadTensorAsFloat(
    std::string_view name, absl::Span<const int64_t> expected_shape,
    std::vector<float>* out) const {
  const SafetensorsFile* f = FileFor(name);
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(source_, ": tensor '", AV(name), "' not found"));
  }
  return specserve::ReadTensorAsFloat(*f, name, expected_shape, out);
}

absl::StatusOr<RawTensor> Checkpoint::ViewTensor(
    std::string_view name, absl::Span<const int64_t> expected_shape) const {
  const SafetensorsFile* f = FileFor(name);
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(source_, ": tensor '", AV(name), "' not found"));
  }
  return specserve::ViewTensor(*f, name, expected_shape);
}

absl::Status Checkpoint::ReadTensorInto(
    std::string_view name, absl::Span<const int64_t> expected_shape,
    absl::Span<float> dst) const {
  const SafetensorsFile* f = FileFor(name);
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(source_, ": tensor '", AV(name), "' not found"));
  }
  return specserve::ReadTensorInto(*f, name, expected_shape, dst);
}

// ---------------------------------------------------------------------------
// Writing

absl::StatusOr<std::string> BuildSafetensorsHeader(
    const std::vector<TensorSpec>& specs,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("__metadata__ entry '", k, "' is not valid UTF-8"));
      }
    }
    j["__metadata__"] = metadata;
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorSpec& s : specs) {
    if (s.name.empty() || s.name == "__metadata__" || !IsValidUtf8(s.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid tensor name '", s.name, "'"));
    }
    if (!names.insert(s.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", s.name, "' given more than once"));
    }
    if (!IsFloatWeightType(s.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", s.name, "': cannot write dtype ",
                       AV(DTypeName(s.dtype)), " (F32, F16 or BF16 only)"));
    }
    uint64_t bytes = DTypeSize(s.dtype);
    for (int64_t d : s.shape) {
      if (d < 0 ||
          __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", s.name, "': invalid shape ", ShapeString(s.shape)));
      }
    }
    j[s.name] = {{"dtype", std::string(DTypeName(s.dtype))},
                 {"shape", s.shape},
                 {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = j.dump();
  // Pad with spaces so the data buffer starts 8-byte aligned (as the
  // reference writer does), keeping F32/F64 data naturally aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> header = BuildSafetensorsHeader(specs, metadata);
  if (!header.ok()) {
    return absl::Status(header.status().code(),
                        absl::StrCat(path, ": ", header.status().message()));
  }
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->specs_ = std::move(specs);
  w->file_ = std::fopen(path.c_str(), "wb");
  if (w->file_ == nullptr) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  absl::Status s = w->WriteBytes(header->data(), header->size());
  if (!s.ok()) return s;
  // WriteAt bypasses the FILE buffer: the header must be in the file first.
  if (std::fflush(w->file_) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": write failed: ", std::strerror(errno)));
  }
  uint64_t offset = header->size();
  for (const TensorSpec& spec : w->specs_) {
    w->offsets_.push_back(offset);
    offset += static_cast<uint64_t>(NumElements(spec.shape)) *
              DTypeSize(spec.dtype);
  }
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status SafetensorsWriter::WriteBytes(const void* data, size_t n) {
  if (n > 0 && std::fwrite(data, 1, n, file_) != n) {
    return absl::InternalError(
        absl::StrCat(path_, ": write failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Append(absl::Span<const float> values) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Append after Finish"));
  }
  if (written_at_.load() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Append after WriteAt"));
  }
  constexpr size_t kChunk = 1 << 16;
  while (true) {
    // Skip finished (and empty) tensors.
    while (current_ < specs_.size() &&
           written_in_current_ == NumElements(specs_[current_].shape)) {
      ++current_;
      written_in_current_ = 0;
    }
    if (values.empty()) return absl::OkStatus();
    if (current_ == specs_.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path_, ": ", values.size(), " values beyond the last tensor"));
    }
    const TensorSpec& spec = specs_[current_];
    size_t n = std::min<size_t>(values.size(),
                                NumElements(spec.shape) - written_in_current_);
    if (spec.dtype == DType::kF32) {
      absl::Status s = WriteBytes(values.data(), n * sizeof(float));
      if (!s.ok()) return s;
    } else {
      for (size_t done = 0; done < n;) {
        const size_t m = std::min(kChunk, n - done);
        scratch_.resize(m * DTypeSize(spec.dtype));
        EncodeValues(values.data() + done, m, spec.dtype, scratch_.data());
        absl::Status s = WriteBytes(scratch_.data(), scratch_.size());
        if (!s.ok()) return s;
        done += m;
      }
    }
    written_in_current_ += static_cast<int64_t>(n);
    values.remove_prefix(n);
  }
}

absl::Status SafetensorsWriter::WriteAt(size_t tensor, int64_t first,
                                        absl::Span<const float> values) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": WriteAt after Finish"));
  }
  if (current_ != 0 || written_in_current_ != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": WriteAt after Append"));
  }
  if (tensor >= specs_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": tensor index ", tensor, " of ", specs_.size()));
  }
  const TensorSpec& spec = specs_[tensor];
  const int64_t n = NumElements(spec.shape);
  const int64_t count = static_cast<int64_t>(values.size());
  if (first < 0 || count > n || first > n - count) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": elements [", first, ", ", first + count,
                     ") outside tensor '", spec.name, "' of ", n));
  }
  const size_t width = DTypeSize(spec.dtype);
  std::vector<uint8_t> bytes;
  const void* data = values.data();
  if (spec.dtype != DType::kF32) {
    bytes.resize(values.size() * width);
    EncodeValues(values.data(), values.size(), spec.dtype, bytes.data());
    data = bytes.data();
  }
  const size_t size = values.size() * width;
  const uint64_t at = offsets_[tensor] + static_cast<uint64_t>(first) * width;
  const int fd = fileno(file_);
  for (size_t done = 0; done < size;) {
    const ssize_t k = pwrite(fd, static_cast<const char*>(data) + done,
                             size - done, static_cast<off_t>(at + done));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      return absl::InternalError(
          absl::StrCat(path_, ": write failed: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(k);
  }
  written_at_.fetch_add(count);
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Finish called twice"));
  }
  if (const int64_t at = written_at_.load(); at > 0) {
    int64_t total = 0;
    for (const TensorSpec& spec : specs_) total += NumElements(spec.shape);
    if (at != total) {
      return absl::FailedPreconditionError(absl::StrCat(
          path_, ": WriteAt wrote ", at, " of ", total, " elements"));
    }
  } else {
    absl::Status s = Append({});  // skips trailing empty tensors
    if (!s.ok()) return s;
  }
  if (written_at_.load() == 0 && current_ != specs_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": tensor '", specs_[current_].name, "' got ",
                     written_in_current_, " of ",
                     NumElements(specs_[current_].shape), " values"));
  }
  std::FILE* f = file_;
  file_ = nullptr;
  bool ok = std::fflush(f) == 0;
  int err = errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    return absl::InternalError(
        absl::StrCat(path_, ": write failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckValueCounts(const std::vector<NamedTensor>& tensors) {
  for (const NamedTensor& t : tensors) {
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "': invalid shape ", ShapeString(t.shape)));
      }
    }
    if (static_cast<int64_t>(t.values.size()) != NumElements(t.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' has ", t.values.size(), " values but shape ",
          ShapeString(t.shape), " needs ", NumElements(t.shape)));
    }
  }
  return absl::OkStatus();
}

std::vector<TensorSpec> SpecsOf(const std::vector<NamedTensor>& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const NamedTensor& t : tensors) {
    specs.push_back({t.name, t.shape, t.dtype});
  }
  return specs;
}

}  // namespace

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<NamedTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  absl::Status s = CheckValueCounts(tensors);
  if (!s.ok()) return s;
  absl::StatusOr<std::string> out =
      BuildSafetensorsHeader(SpecsOf(tensors), metadata);
  if (!out.ok()) return out.status();
  for (const NamedTensor& t : tensors) {
    const size_t pos = out->size();
    out->resize(pos + t.values.size() * DTypeSize(t.dtype));
    EncodeValues(t.values.data(), t.values.size(), t.dtype,
                 reinterpret_cast<uint8_t*>(out->data()) + pos);
  }
  return out;
}

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<NamedTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  absl::Status s = CheckValueCounts(tensors);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(path, SpecsOf(tensors), metadata);
  if (!w.ok()) return w.status();
  for (const NamedTensor& t : tensors) {
    if ((s = (*w)->Append(t.values)); !s.ok()) return s;
  }
  return (*w)->Finish();
}

}  // namespace specserve
