// Mutation test for the safetensors header parser: thousands of randomly
// corrupted copies of a valid file (fixed seed) must each parse to OK or an
// error status naming the file, never crash or read out of bounds; whatever
// parses OK must satisfy every invariant SafetensorsHeader promises.
// Run it under AddressSanitizer too:
//   bazel test --config=asan //common/model:safetensors_fuzz_test

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

constexpr char kFileName[] = "fuzz.safetensors";
constexpr int kIterations = 20000;

std::string BaseFile() {
  std::vector<NamedTensor> ts;
  ts.push_back({"model.embed_tokens.weight",
                {4, 3},
                {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}});
  ts.push_back({"model.norm.weight", {3}, {1, 1, 1}, DType::kBF16});
  ts.push_back({"half", {2, 2}, {0.5f, -0.5f, 2, 65504}, DType::kF16});
  ts.push_back({"scalar", {}, {3.0f}});
  ts.push_back({"empty", {0, 7}, {}});
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors(ts, {{"format", "pt"}, {"note", "fuzz"}});
  return bytes.ok() ? *bytes : std::string();
}

uint64_t HeaderLength(const std::string& f) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(f[i]);
  return n;
}

void SetHeaderLength(std::string* f, uint64_t n) {
  for (int i = 0; i < 8; ++i) (*f)[i] = static_cast<char>(n >> (8 * i));
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  uint64_t Next() { return rng_(); }
  size_t Below(size_t n) { return n == 0 ? 0 : Next() % n; }

  // Applies one random corruption to `f` (a whole file).
  void Mutate(std::string* f) {
    if (f->size() < 8) {
      f->append(8 - f->size(), '\0');
    }
    const uint64_t n = HeaderLength(*f);
    // The JSON region, when the length prefix still points inside the file.
    const bool json_ok = n <= f->size() - 8 && n > 0;
    switch (Below(11)) {
      case 0: {  // bit flips in the header JSON
        if (!json_ok) break;
        for (int k = 1 + Below(4); k > 0; --k) {
          (*f)[8 + Below(n)] ^= static_cast<char>(1u << Below(8));
        }
        break;
      }
      case 1:  // bit flip in the length prefix
        (*f)[Below(8)] ^= static_cast<char>(1u << Below(8));
        break;
      case 2: {  // random header length
        static const uint64_t kSpecial[] = {0,
                                            1,
                                            7,
                                            8,
                                            ~uint64_t{0},
                                            uint64_t{1} << 63,
                                            (uint64_t{1} << 32) - 1,
                                            100'000'001};
        uint64_t v;
        switch (Below(3)) {
          case 0:
            v = kSpecial[Below(8)];
            break;
          case 1:
            v = Below(f->size() + 16);
            break;
          default:
            v = Next();
            break;
        }
        SetHeaderLength(f, v);
        break;
      }
      case 3:  // truncation
        f->resize(Below(f->size() + 1));
        break;
      case 4:  // replace a number in the JSON
        if (json_ok) EditJson(f, [&](std::string* j) { ReplaceNumber(j); });
        break;
      case 5:  // delete characters
        if (json_ok) {
          EditJson(f, [&](std::string* j) {
            if (j->empty()) return;
            j->erase(Below(j->size()), 1 + Below(4));
          });
        }
        break;
      case 6:  // duplicate an entry, same or renamed key
        if (json_ok) EditJson(f, [&](std::string* j) { DuplicateEntry(j); });
        break;
      case 7:  // insert JSON punctuation / digits
        if (json_ok) {
          EditJson(f, [&](std::string* j) {
            static const char kChars[] = "{}[]\":,-0123456789e. \\ax";
            j->insert(Below(j->size() + 1), 1,
                      kChars[Below(sizeof(kChars) - 1)]);
          });
        }
        break;
      case 8:  // replace a dtype
        if (json_ok) EditJson(f, [&](std::string* j) { ReplaceDType(j); });
        break;
      case 9:  // swap two bytes of the JSON
        if (json_ok && n > 1) {
          std::swap((*f)[8 + Below(n)], (*f)[8 + Below(n)]);
        }
        break;
      default:  // grow or shrink the data buffer
        if (Below(2) == 0) {
          f->append(Below(64), static_cast<char>(Next()));
        } else if (f->size() > 8 + n && json_ok) {
          f->resize(f->size() - 1 - Below(f->size() - 8 - n));
        }
        break;
    }
  }

 private:
  // Edits the JSON text and (usually) fixes the length prefix to match, so
  // the corruption reaches validation beyond the length check.
  template <typename Fn>
  void EditJson(std::string* f, Fn edit) {
    const uint64_t n = HeaderLength(*f);
    std::string json = f->substr(8, n);
    std::string data = f->substr(8 + n);
    edit(&json);
    if (Below(8) != 0) SetHeaderLength(f, json.size());
    *f = f->substr(0, 8) + json + data;
  }

  void ReplaceNumber(std::string* j) {
    std::vector<std::pair<size_t, size_t>> numbers;  // [begin, end)
    for (size_t i = 0; i < j->size();) {
      if (std::isdigit(static_cast<unsigned char>((*j)[i]))) {
        size_t e = i;
        while (e < j->size() &&
               std::isdigit(static_cast<unsigned char>((*j)[e]))) {
          ++e;
        }
        numbers.emplace_back(i, e);
        i = e;
      } else {
        ++i;
      }
    }
    if (numbers.empty()) return;
    static const char* kValues[] = {"0",
                                    "1",
                                    "-1",
                                    "2",
                                    "3",
                                    "4",
                                    "8",
                                    "12",
                                    "16",
                                    "24",
                                    "48",
                                    "4294967296",
                                    "9223372036854775807",
                                    "9223372036854775808",
                                    "18446744073709551615",
                                    "18446744073709551616",
                                    "1e30",
                                    "3.5",
                                    "-0",
                                    "1e400",
                                    "null",
                                    "\"7\"",
                                    "[]",
                                    "{}",
                                    "true"};
    std::string v = kValues[Below(sizeof(kValues) / sizeof(kValues[0]))];
    if (Below(3) == 0) v = absl::StrCat(Below(200));
    const auto [b, e] = numbers[Below(numbers.size())];
    j->replace(b, e - b, v);
  }

  void ReplaceDType(std::string* j) {
    static const char* kDTypes[] = {"F32", "F16", "BF16", "F64",
                                    "I64", "I8",  "BOOL", "F8_E4M3",
                                    "Q4",  "",    "f32",  "U64"};
    const size_t at = j->find("\"dtype\":\"", Below(j->size()));
    if (at == std::string::npos) return;
    const size_t begin = at + 9;
    const size_t end = j->find('"', begin);
    if (end == std::string::npos) return;
    j->replace(begin, end - begin, kDTypes[Below(12)]);
  }

  void DuplicateEntry(std::string* j) {
    // Entries look like "name":{...} with no nested objects inside.
    const size_t open = j->find(":{", Below(j->size()));
    if (open == std::string::npos) return;
    const size_t key_begin = j->rfind('"', j->rfind('"', open - 1) - 1);
    const size_t close = j->find('}', open);
    if (key_begin == std::string::npos || close == std::string::npos) return;
    std::string entry = j->substr(key_begin, close + 1 - key_begin);
    if (Below(2) == 0 && entry.size() > 2) entry.insert(1, "x");  // rename
    const size_t insert_at = j->find_last_of('}');
    if (insert_at == std::string::npos) return;
    j->insert(insert_at, "," + entry);
  }

  std::mt19937_64 rng_;
};

// Checks everything ParseSafetensorsHeader promises about an OK header, and
// reads every float tensor (under ASan an out-of-bounds read would abort).
void CheckValid(const std::string& f, const SafetensorsHeader& h) {
  ASSERT_GE(f.size(), 8u);
  ASSERT_EQ(h.header_size, HeaderLength(f));
  ASSERT_EQ(h.data_start, 8 + h.header_size);
  ASSERT_LE(h.data_start, f.size());
  ASSERT_EQ(h.data_size, f.size() - h.data_start);
  std::vector<const TensorInfo*> nonempty;
  for (const TensorInfo& t : h.tensors) {
    ASSERT_LE(t.begin, t.end) << t.name;
    ASSERT_LE(t.end, h.data_size) << t.name;
    ASSERT_EQ(t.end - t.begin,
              static_cast<uint64_t>(t.num_elements()) * DTypeSize(t.dtype))
        << t.name;
    if (t.end > t.begin) nonempty.push_back(&t);
  }
  std::sort(nonempty.begin(), nonempty.end(),
            [](const TensorInfo* a, const TensorInfo* b) {
              return a->begin < b->begin;
            });
  for (size_t i = 1; i < nonempty.size(); ++i) {
    ASSERT_LE(nonempty[i - 1]->end, nonempty[i]->begin);
  }
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(f, kFileName);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TensorInfo& t : (*file)->tensors()) {
    std::vector<float> out;
    absl::Status s = ReadTensorAsFloat(**file, t.name, t.shape, &out);
    const bool is_float = t.dtype == DType::kF32 || t.dtype == DType::kF16 ||
                          t.dtype == DType::kBF16;
    ASSERT_EQ(s.ok(), is_float) << s;
    if (is_float) {
      ASSERT_EQ(out.size(), static_cast<size_t>(t.num_elements()));
    }
    uint64_t sum = 0;  // touch every raw byte
    for (uint8_t b : (*file)->RawBytes(t)) sum += b;
    (void)sum;
  }
}

TEST(SafetensorsFuzzTest, BaseFileIsValid) {
  const std::string base = BaseFile();
  ASSERT_FALSE(base.empty());
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(base, kFileName);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 5u);
  CheckValid(base, *h);
}

TEST(SafetensorsFuzzTest, RandomCorruptionsNeverCrash) {
  const std::string base = BaseFile();
  ASSERT_FALSE(base.empty());
  Mutator m(/*seed=*/20250214);
  int ok = 0, errors = 0;
  for (int iter = 0; iter < kIterations; ++iter) {
    std::string f = base;
    // Mostly single corruptions, sometimes stacked ones.
    for (int k = 1 + (m.Below(4) == 0 ? m.Below(4) : 0); k > 0; --k) {
      m.Mutate(&f);
    }
    absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(f, kFileName);
    if (h.ok()) {
      ++ok;
      CheckValid(f, *h);
      if (::testing::Test::HasFatalFailure()) {
        FAIL() << "iteration " << iter;
      }
    } else {
      ++errors;
      ASSERT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument)
          << "iteration " << iter << ": " << h.status();
      ASSERT_THAT(std::string(h.status().message()),
                  ::testing::HasSubstr(kFileName))
          << "iteration " << iter;
    }
  }
  // Both outcomes must be well represented, or the mutations are not
  // exercising the validator.
  EXPECT_GT(ok, kIterations / 50);
  EXPECT_GT(errors, kIterations / 2);
  std::printf("mutations: %d, parsed OK: %d, rejected: %d\n", kIterations, ok,
              errors);
}

}  // namespace
}  // namespace specserve
