#!/usr/bin/env bash
# Idempotent host set-up for `make up` and `make test`: installs the system packages the
# orchestrator needs, then makes sure dockerd (with gVisor's runsc registered when present)
# and Redis are running. Safe to run again and again; does nothing that is already done.
set -euo pipefail

log() { printf '[host-setup] %s\n' "$*"; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "must run as root (installs packages and starts dockerd); try: sudo make up"
    exit 1
  fi
}

install_packages() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  command -v runsc >/dev/null 2>&1 || missing+=(runsc)
  # crun: the OCI runtime of runc-class sandboxes (a C runc; a create costs a fraction of
  # runc's CPU, see docs/architecture.md "Cheaper cold starts").
  command -v crun >/dev/null 2>&1 || missing+=(crun)
  # Each sandbox's /workspace is capped by an ext4 image of its own, loop-mounted.
  command -v mkfs.ext4 >/dev/null 2>&1 || missing+=(e2fsprogs)
  command -v losetup >/dev/null 2>&1 || missing+=(mount)
  # The sandbox_tests grader applies a row's test patch to the pristine tree on the host.
  command -v patch >/dev/null 2>&1 || missing+=(patch)
  # tests/k8s/node.py's real kubelet gives pods addresses with these CNI plugins (ptp,
  # host-local, loopback).
  [ -x /usr/lib/cni/ptp ] || missing+=(containernetworking-plugins)
  # Its cluster DNS (dnsmasq, no daemon of its own: the test starts it), and socat, which
  # dockershim's port-forward runs in a pod's network namespace (`kubectl port-forward`).
  # dnsmasq is also each egress network's resolver, and nft its packet filter
  # (sandbox/docker/egress.py).
  command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base)
  command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing+=(nftables)
  command -v socat >/dev/null 2>&1 || missing+=(socat)
  if [ "${#missing[@]}" -eq 0 ]; then
    return
  fi
  need_root
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_daemon_json() {
  # Registers runsc with the flags DESIGN.md found necessary: no network inside gVisor and
  # host-visible Unix sockets, so the exec agent's socket on a bind mount reaches the host;
  # and crun, when usable, for runc-class sandboxes (ORCH_DOCKER_RUNC_RUNTIME, default crun).
  local entries=()
  if command -v runsc >/dev/null 2>&1; then
    entries+=("$(cat <<JSON
    "runsc": {
      "path": "$(command -v runsc)",
      "runtimeArgs": ["--network=none", "--host-uds=create"]
    }
JSON
)")
  fi
  if crun_usable; then
    entries+=("$(cat <<JSON
    "crun": {
      "path": "$(command -v crun)"
    }
JSON
)")
  fi
  local want
  if [ "${#entries[@]}" -eq 0 ]; then
    want='{}'
  else
    local joined
    joined=$(printf '%s,\n' "${entries[@]}")
    want=$(printf '{\n  "runtimes": {\n%s\n  }\n}' "${joined%,}")
  fi
  mkdir -p /etc/docker
  if [ ! -f /etc/docker/daemon.json ] || [ "$(cat /etc/docker/daemon.json)" != "$want" ]; then
    printf '%s\n' "$want" > /etc/docker/daemon.json
    DAEMON_JSON_CHANGED=1
  fi
}

crun_usable() {
  # crun (1.8) refuses a hybrid cgroup host (v1 controllers, and cgroup2 mounted at
  # /sys/fs/cgroup/unified) while cgroup2 still holds a controller: registered only if not.
  command -v crun >/dev/null 2>&1 || return 1
  local unified=/sys/fs/cgroup/unified/cgroup.controllers
  [ ! -f "$unified" ] || [ -z "$(cat "$unified")" ]
}

crun_cgroups() {
  # On a hybrid host, the controllers no v1 hierarchy took (hugetlb here) stay in cgroup2,
  # where nothing enables them (its subtree_control is empty): each is mounted as a v1
  # hierarchy of its own instead, which leaves cgroup2 without controllers, as crun wants.
  local unified=/sys/fs/cgroup/unified c
  command -v crun >/dev/null 2>&1 || return 0
  [ -f "$unified/cgroup.controllers" ] || return 0
  [ -z "$(cat "$unified/cgroup.subtree_control")" ] || return 0
  for c in $(cat "$unified/cgroup.controllers"); do
    need_root
    log "mounting the $c cgroup controller as v1 (crun refuses it in a hybrid cgroup2)"
    mkdir -p "/sys/fs/cgroup/$c"
    mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" ||
      log "could not: crun is not registered, sandboxes run on runc"
  done
}

install_tool_packages() {
  # Packages wanted for one binary each, whose postinst would also start a server nobody
  # here needs: promtool (prometheus; the chart tests check the alert rules with it) and
  # docker-registry (a real registry for `orchestrator codebase publish`'s test). A
  # policy-rc.d (ours only if none exists) refuses service starts during the install, and
  # on systemd hosts the units are disabled.
  local missing=()
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry)
  [ "${#missing[@]}" -eq 0 ] && return
  need_root
  local policy=/usr/sbin/policy-rc.d ours=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    ours=1
  fi
  log "installing: ${missing[*]} (for their tools; no server is started)"
  export DEBIAN_FRONTEND=noninteractive
  local rc=0
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
  if [ "$rc" -ne 0 ]; then  # a fresh host's package lists may not name them yet
    rc=0
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
  fi
  [ "$ours" = 1 ] && rm -f "$policy"
  [ "$rc" -eq 0 ] || { log "could not install ${missing[*]}"; exit "$rc"; }
  if [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus docker-registry >/dev/null 2>&1 || true
  fi
}

docker_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start_dockerd() {
  DAEMON_JSON_CHANGED=0
  write_daemon_json
  if docker_up; then
    if [ "$DAEMON_JSON_CHANGED" = 1 ]; then
      log "daemon.json changed: reloading dockerd"
      pkill -HUP -x dockerd || true
      # The reload is asynchronous: wait until the daemon lists what daemon.json names.
      local want_runtimes
      want_runtimes=$(grep -o '"[a-z]*": {' /etc/docker/daemon.json | tr -d '":{ ' | grep -vx runtimes | tr '\n' ' ')
      for _ in $(seq 1 40); do
        local have
        have=$(docker info --format '{{range $name, $_ := .Runtimes}}{{$name}} {{end}}' 2>/dev/null || true)
        local missing=0 r
        for r in $want_runtimes; do
          [[ " $have " == *" $r "* ]] || missing=1
        done
        [ "$missing" = 0 ] && break
        sleep 0.25
      done
    fi
    return
  fi
  need_root
  log "starting dockerd (log: /var/log/orchestrator-dockerd.log)"
  nohup dockerd >/var/log/orchestrator-dockerd.log 2>&1 &
  for _ in $(seq 1 120); do
    docker_up && { log "dockerd is up"; return; }
    sleep 0.5
  done
  log "dockerd did not come up; last log lines:"
  tail -n 30 /var/log/orchestrator-dockerd.log >&2 || true
  exit 1
}

redis_up() { redis-cli -p "${ORCH_REDIS_PORT:-6379}" ping 2>/dev/null | grep -q PONG; }

start_redis() {
  if redis_up; then
    return
  fi
  local dir=/var/lib/orchestrator/redis
  mkdir -p "$dir"
  log "starting redis on 127.0.0.1:${ORCH_REDIS_PORT:-6379} (AOF on, data in $dir)"
  redis-server --bind 127.0.0.1 --port "${ORCH_REDIS_PORT:-6379}" --dir "$dir" \
    --appendonly yes --appendfsync everysec --daemonize yes \
    --logfile /var/log/orchestrator-redis.log
  for _ in $(seq 1 40); do
    redis_up && return
    sleep 0.25
  done
  log "redis did not come up"; exit 1
}

loop_devices() {
  # The kernel makes loop devices on demand through /dev/loop-control; without it, load
  # the module (sandboxes with a capped /workspace cannot be created otherwise).
  if [ -e /dev/loop-control ]; then
    return
  fi
  need_root
  modprobe loop 2>/dev/null || true
  if [ ! -e /dev/loop-control ]; then
    log "no loop devices (/dev/loop-control): set ORCH_SANDBOX_DISK_MB=0 to run with an uncapped /workspace"
  fi
}

install_packages
install_tool_packages
loop_devices
crun_cgroups
start_dockerd
start_redis
runtimes=$(docker info --format '{{range $name, $_ := .Runtimes}}{{$name}} {{end}}' 2>/dev/null || true)
log "ready: dockerd (runtimes: ${runtimes% }), redis"
