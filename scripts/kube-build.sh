#!/usr/bin/env bash
# A real Kubernetes cluster for the test suite, from Debian's own packages only: etcd from
# `etcd-server`, and kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and
# kube-proxy built from Debian bookworm's `kubernetes` source package (the full upstream
# tree with vendor/, built offline with Debian's Go). No registry ships these binaries, so
# they are built once per version and cached on the machine, outside the repository:
#
#   $KUBE_CACHE/<debian version>/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,
#                                     kubelet,kube-proxy}
#   $KUBE_CACHE/<debian version>/pause/pause   (static; also the local image $KUBE_PAUSE_IMAGE)
#
# No registry is reachable either, so the kubelet's pod infra ("pause") image is built here
# from the tree's own build/pause/linux/pause.c, as a local image FROM scratch.
#
# Idempotent: with everything cached and etcd installed it does nothing (well under a
# second). Only what is missing is built: a cache made before the kubelet was added gets
# kubelet, kube-proxy and pause. A cold build takes about 7 minutes on 2 cores (75 s with a
# warm Go cache). Prints the bin directory. docs/kubernetes-backend.md ("Tested against a real control
# plane") says what the tests do with it.
set -euo pipefail

# The source package's version, pinned: the cache is keyed by it and a bump rebuilds.
KUBE_DEB_VERSION="${KUBE_DEB_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}"
# What clients are told the server is (upstream's version inside Debian's).
KUBE_GIT_VERSION="${KUBE_GIT_VERSION:-v1.20.2}"
KUBE_CACHE="${KUBE_CACHE:-/var/cache/orchestrator/kube}"
GO_PACKAGE=golang-1.19-go
GOROOT_DIR=/usr/lib/go-1.19
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
# The pod infra image the kubelet is told to use (--pod-infra-container-image): a fixed tag,
# the tree's pause version, so tests name it without asking this script.
KUBE_PAUSE_IMAGE="${KUBE_PAUSE_IMAGE:-orchestrator/kube-pause:3.4.1}"

log() { printf '[kube-build] %s\n' "$*" >&2; }

out="$KUBE_CACHE/$KUBE_DEB_VERSION"
bin="$out/bin"

pause_bin="$out/pause/pause"

missing_binaries() {
  local b
  for b in "${BINARIES[@]}"; do
    [ -x "$bin/$b" ] || printf '%s\n' "$b"
  done
}

have_binaries() {
  [ -z "$(missing_binaries)" ] && [ -x "$pause_bin" ]
}

# The image from the cached static binary; only with a Docker daemon (the control plane alone
# needs none), and a failure here leaves the binaries usable: the kubelet's tests say so.
ensure_pause_image() {
  command -v docker >/dev/null 2>&1 || return 0
  docker image inspect "$KUBE_PAUSE_IMAGE" >/dev/null 2>&1 && return 0
  local ctx
  ctx=$(mktemp -d)
  cp "$pause_bin" "$ctx/pause"
  # As upstream's build/pause/Dockerfile: 65535 is the user the pod's PID 1 runs as.
  printf 'FROM scratch\nADD pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' \
    > "$ctx/Dockerfile"
  if docker build -q -t "$KUBE_PAUSE_IMAGE" "$ctx" >/dev/null 2>"$ctx/err"; then
    log "built image $KUBE_PAUSE_IMAGE"
  else
    log "could not build image $KUBE_PAUSE_IMAGE: $(tail -n 5 "$ctx/err")"
  fi
  rm -rf "$ctx"
}

apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
}

# One build at a time (parallel test processes may all ask): the others wait, then find it.
mkdir -p "$KUBE_CACHE"
exec 9>"$KUBE_CACHE/.lock"
flock 9

if ! command -v etcd >/dev/null 2>&1; then
  log "installing etcd-server"
  apt_install etcd-server
  # The package starts a system etcd on 2379; the tests run their own on free ports.
  systemctl disable --now etcd >/dev/null 2>&1 || service etcd stop >/dev/null 2>&1 || true
  pkill -x etcd >/dev/null 2>&1 || true
fi

if have_binaries; then
  ensure_pause_image
  echo "$bin"
  exit 0
fi

mapfile -t wanted < <(missing_binaries)
log "building ${wanted[*]:-pause} of kubernetes $KUBE_DEB_VERSION into $out (cold: about 7 minutes)"
# deb-src for bookworm and its security suite (the package's deb12u1 upload lives there).
src_list=/etc/apt/sources.list.d/orchestrator-kubernetes-src.sources
if [ ! -f "$src_list" ]; then
  cat > "$src_list" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  apt-get update -qq
fi
# dpkg-dev unpacks the source (and applies debian/patches); reflect2 1.0.2 replaces the
# vendored 1.0.1, which makes kube-apiserver SIGSEGV under Go >= 1.18 on the first custom
# resource; jq and rsync are what the tree's hack/ scripts use to generate OpenAPI.
apt_install "$GO_PACKAGE" dpkg-dev golang-github-modern-go-reflect2-dev jq rsync

work="$KUBE_CACHE/build-$KUBE_DEB_VERSION"
rm -rf "$work"
mkdir -p "$work/src"
(cd "$work/src" && apt-get source -qq "kubernetes=$KUBE_DEB_VERSION" >/dev/null 2>&1)
tree=$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
[ -n "$tree" ] || { log "apt-get source produced no tree"; exit 1; }

rm -rf "$tree/vendor/github.com/modern-go/reflect2"
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$tree/vendor/github.com/modern-go/reflect2"

# This machine's patch, not a real cluster's: root here lacks CAP_SYS_RESOURCE, so the
# kernel refuses a negative oom_score_adj and runc fails every container asking one ("can't
# get final child's PID from pipe: EOF"). dockershim asks -998 for each pod's infra
# container and the kubelet -997 for Guaranteed pods' containers (sandboxes are
# Guaranteed): both 0 here, with the kubelet run with --oom-score-adj=0.
patch_oom_adj() {
  local file=$1 name=$2
  sed -i -E "s/^([[:space:]]*$name[[:space:]]+int[[:space:]]*=[[:space:]]*)-[0-9]+/\10/" "$tree/$file"
  grep -Eq "^[[:space:]]*$name[[:space:]]+int[[:space:]]*=[[:space:]]*0\b" "$tree/$file" \
    || { log "could not patch $name in $file"; exit 1; }
}
patch_oom_adj pkg/kubelet/dockershim/docker_sandbox.go defaultSandboxOOMAdj
patch_oom_adj pkg/kubelet/qos/policy.go guaranteedOOMScoreAdj

# The pod infra process, static so its image needs nothing but itself.
mkdir -p "$work/pause"
gcc -Os -Wall -Werror -static -DVERSION="v${KUBE_PAUSE_IMAGE##*:}-debian" \
  -o "$work/pause/pause" "$tree/build/pause/linux/pause.c"

# GOPATH mode (the 1.20 tree does not build in module mode): the tree at its import path.
export GOPATH="$work/gopath"
export GO111MODULE=off
export GOCACHE="$KUBE_CACHE/go-build"
export GOFLAGS=
export PATH="$GOROOT_DIR/bin:$PATH"
mkdir -p "$GOPATH/src/k8s.io"
ln -sfn "$tree" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"

log "generating OpenAPI definitions (not shipped in the source)"
make gen_openapi >"$work/gen_openapi.log" 2>&1 || { tail -n 40 "$work/gen_openapi.log" >&2; exit 1; }

major=${KUBE_GIT_VERSION#v}
major=${major%%.*}
minor=${KUBE_GIT_VERSION#v*.}
minor=${minor%%.*}
ldflags=""
for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
           k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBE_GIT_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
mkdir -p "$work/bin"
for b in "${wanted[@]}"; do
  log "go build $b"
  go build -o "$work/bin/$b" -ldflags "-s -w $ldflags" "./cmd/$b" 2>"$work/build-$b.log" \
    || { tail -n 40 "$work/build-$b.log" >&2; exit 1; }
done

# Each file published whole (a rename) and the pause binary last, so a build cut half-way
# is never taken for a cached one; binaries already cached stay as they are.
mkdir -p "$bin" "$out/pause"
for b in "${wanted[@]}"; do
  mv "$work/bin/$b" "$bin/$b"
done
mv "$work/pause/pause" "$pause_bin"
cd /
rm -rf "$work"
ensure_pause_image
log "built: $bin"
echo "$bin"
