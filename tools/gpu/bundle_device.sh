#!/usr/bin/env bash
# Packs everything a device session runs into one folder to carry:
# OUT/bundle.tar.xz holds the CUDA test / bench bundle
# (bundle_gpu_tests.sh) and the stack bundle (bundle_stack.sh) merged into
# one bin/ + lib/ (the libraries they share once), xz-compressed. Side by
# side the two bundles pass the device tool's 64 MiB carry limit; packed
# they take ~a third of it, so one call can run tests, the engine
# benchmark and the stack benchmark (tools/gpu/device_session.sh unpacks
# it on the GPU machine).
#
#   tools/gpu/bundle_device.sh [OUT]          (default .device/session)
#   then: run(command="tools/gpu/device_session.sh",
#             carry=[".device/session"], timeout_s=600)
#
# BINARIES_FROM=DIR takes the binaries from DIR (bazel-bin layout) instead
# of building them, as the two bundle scripts do.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.device/session}
WORK=$(mktemp -d -t specserve-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
bash tools/gpu/bundle_gpu_tests.sh "$WORK/gpu"
bash tools/gpu/bundle_stack.sh "$WORK/stack"
mkdir -p "$WORK/all/bin" "$WORK/all/lib"
cp "$WORK/gpu/tests.txt" "$WORK/all/"
# xz compresses the raw library better than gzip's output.
gzip -d "$WORK/gpu/lib/libopenblas.so.0.gz"
# bundle_gpu_tests.sh strips its binaries; strip the stack's the same way
# (make_synthetic_checkpoint is in both).
strip --strip-unneeded "$WORK"/stack/bin/*
for part in gpu stack; do
  for f in "$WORK/$part"/bin/* "$WORK/$part"/lib/*; do
    dest="$WORK/all/${f#"$WORK/$part/"}"
    # A name in both bundles is the same file (the same build, the same
    # system library); a difference would be a bug here.
    if [ -e "$dest" ] && ! cmp -s "$f" "$dest"; then
      echo "bundle_device: $part's ${f#"$WORK/$part/"} differs from the" \
           "other bundle's" >&2
      exit 1
    fi
    cp "$f" "$dest"
  done
done
rm -rf "$OUT"
mkdir -p "$OUT"
tar -cf - -C "$WORK/all" . | xz -T0 -6 > "$OUT/bundle.tar.xz"
echo "bundle_device: $(du -sh "$WORK/all" | cut -f1) of binaries and" \
     "libraries, $(du -sh "$OUT/bundle.tar.xz" | cut -f1) packed in" \
     "$OUT/bundle.tar.xz"
