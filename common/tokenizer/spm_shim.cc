// Isolation shim for Debian's libsentencepiece (0.1.97).
//
// Why this file exists and looks the way it does:
//
// 1. libsentencepiece.so.0 as packaged by Debian 12 statically bundles its
//    own protobuf 3.14 and EXPORTS those symbols. Every gRPC binary here also
//    loads the system libprotobuf 3.21; linking both into one process makes
//    the dynamic linker mix the two protobuf copies (descriptor pools,
//    arenas), which crashes at startup. So we never link the library
//    (//third_party:sentencepiece is deliberately unused). Instead we
//    dlopen() it with RTLD_LOCAL | RTLD_DEEPBIND: its symbols stay out of the
//    global scope, and its own references resolve to its own protobuf copy
//    first.
// 2. Because nothing is linked, no call may need a link-time symbol from the
//    library. We obtain the constructor by dlsym() and run it on raw storage
//    of sizeof(SentencePieceProcessor); after that we call only VIRTUAL member
//    functions, which dispatch through the library's own vtable. The
//    util::Status values they return are built in place in an aligned buffer
//    (C++17 guaranteed copy elision, so no copy constructor is referenced),
//    inspected with the inline ok(), and their non-inline members
//    (ToString, code, the destructor) are again reached through dlsym().
//    -fno-devirtualize (see BUILD.bazel) keeps GCC from speculatively
//    inlining a virtual target, which would reference the library's vtable.
// 3. sentencepiece_processor.h defines `namespace absl { using
//    std::string_view; }`, which clashes with the real Abseil headers, so
//    this translation unit includes no Abseil header and spm_shim.h exposes
//    std types only.
//
// Sanitizers: ASan does not support RTLD_DEEPBIND (it aborts in dlopen), so
// under ASan we load without it. That is safe only in processes that do not
// also load libprotobuf. The sanitizer configs (--config=asan / tsan) do not
// link this shim at all: they set --define=spm=builtin, and LoadTokenizer
// reads tokenizer.model with BuiltinSpmTokenizer (spm_builtin.h).

#include "common/tokenizer/spm_shim.h"

#include <dlfcn.h>

#include <exception>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "sentencepiece_processor.h"

namespace specserve {
namespace spm_shim {
namespace {

using SpProcessor = ::sentencepiece::SentencePieceProcessor;
using SpStatus = ::sentencepiece::util::Status;

#if defined(__SANITIZE_ADDRESS__)
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL;
#else
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
#endif

constexpr char kLibName[] = "libsentencepiece.so.0";

// Entry points of the isolated library, resolved once.
struct Library {
  void* handle = nullptr;
  std::string error;  // Non-empty when loading failed.
  void (*processor_ctor)(void*) = nullptr;
  std::string (*status_to_string)(const SpStatus*) = nullptr;
  int (*status_code)(const SpStatus*) = nullptr;
  void (*status_dtor)(SpStatus*) = nullptr;
};

Library OpenLibrary() {
  Library lib;
  lib.handle = dlopen(kLibName, kDlopenFlags);
  if (lib.handle == nullptr) {
    const char* err = dlerror();
    lib.error = std::string("dlopen(") + kLibName +
                ") failed: " + (err != nullptr ? err : "unknown error");
    return lib;
  }
  auto sym = [&lib](const char* name) -> void* {
    void* p = dlsym(lib.handle, name);
    if (p == nullptr && lib.error.empty()) {
      lib.error = std::string(kLibName) + " lacks symbol " + name;
    }
    return p;
  };
  lib.processor_ctor = reinterpret_cast<void (*)(void*)>(
      sym("_ZN13sentencepiece22SentencePieceProcessorC1Ev"));
  lib.status_to_string = reinterpret_cast<std::string (*)(const SpStatus*)>(
      sym("_ZNK13sentencepiece4util6Status8ToStringB5cxx11Ev"));
  lib.status_code = reinterpret_cast<int (*)(const SpStatus*)>(
      sym("_ZNK13sentencepiece4util6Status4codeEv"));
  lib.status_dtor = reinterpret_cast<void (*)(SpStatus*)>(
      sym("_ZN13sentencepiece4util6StatusD1Ev"));
  return lib;
}

const Library& GetLibrary() {
  static const Library* const lib = new Library(OpenLibrary());
  return *lib;
}

ShimCode FromSpCode(int code) {
  switch (code) {
    case 0:
      return ShimCode::kOk;
    case 3:  // kInvalidArgument
      return ShimCode::kInvalidArgument;
    case 5:  // kNotFound
      return ShimCode::kNotFound;
    default:
      return ShimCode::kInternal;
  }
}

// Runs `fn` (returning a util::Status prvalue) and converts the result,
// destroying the Status through the library's own destructor.
template <typename Fn>
ShimStatus RunStatus(Fn&& fn) {
  const Library& lib = GetLibrary();
  alignas(SpStatus) unsigned char buf[sizeof(SpStatus)];
  SpStatus* s = nullptr;
  // The library may throw (e.g. protobuf's version check when it is bound to
  // the wrong protobuf); keep exceptions from crossing into our code.
  try {
    s = ::new (static_cast<void*>(buf)) SpStatus(fn());
  } catch (const std::exception& e) {
    return {ShimCode::kInternal,
            std::string("libsentencepiece threw: ") + e.what()};
  } catch (...) {
    return {ShimCode::kInternal, "libsentencepiece threw an exception"};
  }
  ShimStatus out;
  if (!s->ok()) {
    out.code = FromSpCode(lib.status_code(s));
    if (out.code == ShimCode::kOk) out.code = ShimCode::kInternal;
    out.message = lib.status_to_string(s);
  }
  lib.status_dtor(s);
  return out;
}

const SpProcessor* Proc(const void* p) {
  return static_cast<const SpProcessor*>(p);
}

}  // namespace

std::unique_ptr<SpmProcessor> SpmProcessor::Load(const std::string& path,
                                                 ShimStatus* status) {
  const Library& lib = GetLibrary();
  if (!lib.error.empty()) {
    *status = {ShimCode::kUnavailable, lib.error};
    return nullptr;
  }
  void* mem = ::operator new(sizeof(SpProcessor));
  try {
    lib.processor_ctor(mem);
  } catch (...) {
    ::operator delete(mem);
    *status = {ShimCode::kInternal,
               "SentencePieceProcessor constructor threw an exception"};
    return nullptr;
  }
  auto* proc = static_cast<SpProcessor*>(mem);
  *status = RunStatus([&] { return proc->Load(std::string_view(path)); });
  if (!status->ok()) {
    delete proc;  // Virtual destructor: runs the library's deleting dtor.
    return nullptr;
  }
  return std::unique_ptr<SpmProcessor>(new SpmProcessor(proc));
}

SpmProcessor::~SpmProcessor() { delete static_cast<SpProcessor*>(processor_); }

ShimStatus SpmProcessor::Encode(std::string_view text,
                                std::vector<int>* ids) const {
  ids->clear();
  return RunStatus([&] { return Proc(processor_)->Encode(text, ids); });
}

ShimStatus SpmProcessor::Decode(const std::vector<int>& ids,
                                std::string* text) const {
  text->clear();
  return RunStatus([&] { return Proc(processor_)->Decode(ids, text); });
}

std::string SpmProcessor::IdToPiece(int id) const {
  return Proc(processor_)->IdToPiece(id);
}
int SpmProcessor::GetPieceSize() const {
  return Proc(processor_)->GetPieceSize();
}
bool SpmProcessor::IsControl(int id) const {
  return Proc(processor_)->IsControl(id);
}
bool SpmProcessor::IsByte(int id) const { return Proc(processor_)->IsByte(id); }
bool SpmProcessor::IsUnknown(int id) const {
  return Proc(processor_)->IsUnknown(id);
}
bool SpmProcessor::IsUnused(int id) const {
  return Proc(processor_)->IsUnused(id);
}
int SpmProcessor::bos_id() const { return Proc(processor_)->bos_id(); }
int SpmProcessor::eos_id() const { return Proc(processor_)->eos_id(); }
int SpmProcessor::unk_id() const { return Proc(processor_)->unk_id(); }
int SpmProcessor::pad_id() const { return Proc(processor_)->pad_id(); }

}  // namespace spm_shim
}  // namespace specserve
