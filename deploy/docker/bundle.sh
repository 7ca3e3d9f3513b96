#!/usr/bin/env bash
# Copies a Bazel-built binary and the shared libraries it needs into OUT
# (OUT/bin, OUT/lib) so that the runtime stage needs no -dev packages and can
# sit on any glibc >= the build stage's (debian:bookworm-slim or a CUDA
# runtime image). The C runtime (glibc, libstdc++, libgcc_s) comes from the
# runtime image, and so do CUDA's libraries (the CUDA runtime base; the
# driver's libcuda is injected by the NVIDIA container toolkit).
# libsentencepiece.so.0 is dlopen()ed by common/tokenizer/spm_shim.cc, so
# ldd cannot see it: it is added by name.
#   bundle.sh BINARY OUT
set -euo pipefail
bin="$1" out="$2"
mkdir -p "$out/bin" "$out/lib"
cp -L "$bin" "$out/bin/"
objs=("$bin")
# awk reads all of ldconfig's output (no early `exit`): under pipefail an
# early exit would kill ldconfig with SIGPIPE on long caches (exit 141).
spm=$(ldconfig -p | awk '$1 == "libsentencepiece.so.0" && !found {print $NF; found = 1}')
if [[ -n "$spm" ]]; then objs+=("$spm"); cp -L "$spm" "$out/lib/"; fi
system='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnvidia-[a-z]+)\.so'
for o in "${objs[@]}"; do
  # "libfoo.so.1 => /path/libfoo.so.1 (0x...)": keep the soname as the name.
  ldd "$o" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' |
    while read -r name path; do
      [[ "$name" =~ $system ]] || cp -L "$path" "$out/lib/$name"
    done
done
if [[ "$(ldd "$bin")" == *'not found'* ]]; then
  echo "bundle.sh: unresolved libraries for $bin" >&2; exit 1
fi
