#!/usr/bin/env bash
# Redis behind Sentinel on this machine, for `make up REDIS=sentinel`: a primary and two
# replicas (AOF each) and three Sentinels, all on loopback, with Debian's redis-server.
# Prints the URL the stack is given (ORCH_REDIS_URL=redis+sentinel://...). Idempotent: what
# answers is left alone; what does not is started, a Redis as a replica of the primary the
# Sentinels name (or, none answering, the one their files name last; the first port on the
# set's first start), so a server that died and comes back never leads with stale data.
# docs/failure-model.md, "Redis failover", says what the deployment does with it.
#
# Settings (environment): ORCH_SENTINEL_DIR (data, logs, the Sentinels' files),
# ORCH_SENTINEL_REDIS_PORTS and ORCH_SENTINEL_PORTS (three ports each, spaces between),
# ORCH_SENTINEL_SERVICE (the name the primary is watched under), ORCH_SENTINEL_DOWN_AFTER_MS.
set -euo pipefail

dir="${ORCH_SENTINEL_DIR:-/var/lib/orchestrator/redis-sentinel}"
read -r -a redis_ports <<< "${ORCH_SENTINEL_REDIS_PORTS:-6380 6381 6382}"
read -r -a sentinel_ports <<< "${ORCH_SENTINEL_PORTS:-26380 26381 26382}"
service="${ORCH_SENTINEL_SERVICE:-orchestrator}"
down_after="${ORCH_SENTINEL_DOWN_AFTER_MS:-5000}"

log() { printf '[redis-sentinel] %s\n' "$*" >&2; }
answers() { redis-cli -p "$1" ping 2>/dev/null | grep -q PONG; }

primary=""
for port in "${sentinel_ports[@]}"; do
  named=$(timeout 3 redis-cli -p "$port" SENTINEL get-master-addr-by-name "$service" 2>/dev/null \
    | sed -n 2p) || true
  if [ -n "$named" ]; then primary=$named; break; fi
done
if [ -z "$primary" ] && [ -f "$dir/s0/sentinel.conf" ]; then
  primary=$(awk -v s="$service" '$1 == "sentinel" && $2 == "monitor" && $3 == s { print $5 }' \
    "$dir/s0/sentinel.conf")
fi
primary="${primary:-${redis_ports[0]}}"

for i in 0 1 2; do
  port=${redis_ports[$i]}
  answers "$port" && continue
  mkdir -p "$dir/r$i"
  args=(--bind 127.0.0.1 --port "$port" --dir "$dir/r$i" --appendonly yes --appendfsync everysec
        --protected-mode no --daemonize yes --logfile "$dir/r$i/redis.log")
  if [ "$port" != "$primary" ]; then
    args+=(--replicaof 127.0.0.1 "$primary")
  fi
  log "starting redis on 127.0.0.1:$port ($([ "$port" = "$primary" ] && echo primary || echo "replica of $primary"))"
  redis-server "${args[@]}"
done

for i in 0 1 2; do
  port=${sentinel_ports[$i]}
  answers "$port" && continue
  mkdir -p "$dir/s$i"
  # A Sentinel rewrites its own file with what it learns; written afresh at each start,
  # with the primary just found.
  cat > "$dir/s$i/sentinel.conf.new" <<EOF
port $port
bind 127.0.0.1
protected-mode no
daemonize yes
dir $dir/s$i
logfile $dir/s$i/sentinel.log
sentinel monitor $service 127.0.0.1 $primary 2
sentinel down-after-milliseconds $service $down_after
sentinel failover-timeout $service 60000
sentinel parallel-syncs $service 1
EOF
  mv "$dir/s$i/sentinel.conf.new" "$dir/s$i/sentinel.conf"  # whole: a later run reads it
  log "starting a Sentinel on 127.0.0.1:$port"
  redis-server "$dir/s$i/sentinel.conf" --sentinel
done

for port in "${redis_ports[@]}" "${sentinel_ports[@]}"; do
  for _ in $(seq 1 80); do
    answers "$port" && break
    sleep 0.25
  done
  answers "$port" || { log "127.0.0.1:$port did not come up: see $dir"; exit 1; }
done

hosts=""
for port in "${sentinel_ports[@]}"; do
  hosts+="${hosts:+,}127.0.0.1:$port"
done
echo "redis+sentinel://$hosts/$service/0"
