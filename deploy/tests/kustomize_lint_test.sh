#!/usr/bin/env bash
# Renders the kustomize base and every overlay with kubectl (no cluster
# needed) and runs yamllint (deploy/.yamllint) over all deploy/ YAML.
set -euo pipefail
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
command -v kubectl > /dev/null || { echo "kubectl (with kustomize) is not installed"; exit 1; }
command -v yamllint > /dev/null || { echo "yamllint is not installed (tools/install_deps.sh)"; exit 1; }

# A real copy: kustomize rejects symlinks that point outside its root.
cp -rL deploy/k8s "$TMP/k8s"
for dir in base overlays/local-cpu overlays/gpu overlays/local-cpu-tls; do
  out="$TMP/$(echo "$dir" | tr / _).yaml"
  kubectl kustomize "$TMP/k8s/$dir" > "$out"
  n=$(grep -c '^kind: ' "$out")
  echo "rendered $dir: $n objects"
  (( n >= 15 )) || { echo "too few objects from $dir"; exit 1; }
done

mkdir -p "$TMP/lint"
cp -rL deploy/k8s deploy/prometheus "$TMP/lint/"
cp -L deploy/.yamllint "$TMP/lint/.yamllint"
n=$(cd "$TMP/lint" && yamllint --list-files . | grep -c '\.ya\?ml$')
(( n >= 15 )) || { echo "yamllint found only $n YAML files"; exit 1; }
(cd "$TMP/lint" && yamllint --strict -c .yamllint .)
echo "yamllint: $n files clean"
echo PASS
