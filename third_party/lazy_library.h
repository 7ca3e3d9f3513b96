#ifndef SPECSERVE_THIRD_PARTY_LAZY_LIBRARY_H_
#define SPECSERVE_THIRD_PARTY_LAZY_LIBRARY_H_

// Shared libraries loaded with dlopen on first use instead of linked.
//
// Why: glibc reserves the thread-local storage of every library loaded at
// startup in EVERY thread's stack. OpenBLAS (60 KiB), cuBLAS and cuBLASLt
// (106 KiB) together exceed the fixed 100 KiB stack that Debian's civetweb
// (under prometheus-cpp's /metrics Exposer) gives its threads, so its
// pthread_create fails (EINVAL) or its workers overflow. TLS of a library
// loaded with dlopen is allocated lazily, per thread, on first access.

#include <dlfcn.h>

#include <initializer_list>

namespace specserve {
namespace lazy_library {

/// Handle of the first of `paths` dlopen can load (RTLD_NOW | RTLD_LOCAL),
/// or nullptr when none loads.
inline void* LoadFirst(std::initializer_list<const char*> paths) {
  for (const char* p : paths) {
    if (void* h = dlopen(p, RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

/// `symbol` of `library` as a function pointer of type Fn; nullptr when the
/// library did not load or lacks the symbol.
template <typename Fn>
Fn Resolve(void* library, const char* symbol) {
  return library == nullptr ? nullptr
                            : reinterpret_cast<Fn>(dlsym(library, symbol));
}

}  // namespace lazy_library
}  // namespace specserve

#endif  // SPECSERVE_THIRD_PARTY_LAZY_LIBRARY_H_
