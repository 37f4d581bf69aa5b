#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the kubeps test suite.
#
#   hack/controlplane.sh build   compile etcd, kube-apiserver, kube-controller-manager,
#                                kube-scheduler, kubectl and kwok from the Go module
#                                proxy into a cache outside the repo (instant when cached)
#   hack/controlplane.sh up      start etcd, the API server, controller-manager, scheduler
#                                and kwok with 4 fake nodes; idempotent. The API server,
#                                controller-manager and scheduler run with the GenericWorkload
#                                and GangScheduling feature gates (Kubernetes' own gang scheduling)
#   hack/controlplane.sh down    stop exactly the processes `up` started (recorded PIDs)
#   hack/controlplane.sh env     print `export KUBECONFIG=...` (eval "$(... env)")
#   hack/controlplane.sh status  say whether it is up, with PIDs and RSS
#   hack/controlplane.sh bin-dir print the directory holding the binaries
#
# Versions come from hack/controlplane/go.mod (Kubernetes, etcd) and KWOK_VERSION below.
# Environment:
#   KUBEPS_CP_DIR    state dir: certs, kubeconfigs, etcd data, logs, PIDs
#                    (default /tmp/kubeps-cp-$UID)
#   KUBEPS_CP_CACHE  binary cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/controlplane)
#   GO               go binary (default: go on PATH, else /usr/local/go/bin/go)
#   KUBEPS_CP_ETCD   an etcd binary to use instead of the built one (e.g. Debian's
#                    /usr/bin/etcd; 3.4.23 works but lacks RequestWatchProgress, see docs/testing.md)
#   KUBEPS_CP_BUILD_JOBS  parallel go build jobs (default 2)
#   (a file named .ephemeral in the state dir makes `down` delete the whole dir)
#   KUBEPS_CP_WATCH_PID   `up` also starts a watchdog that runs `down` once this PID
#                    is gone (the test fixture passes its own PID, so a killed
#                    pytest does not leave a control plane behind)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MOD_DIR="$ROOT/controlplane"
KWOK_VERSION="v0.8.0"

STATE="${KUBEPS_CP_DIR:-/tmp/kubeps-cp-$(id -u)}"
CACHE_ROOT="${KUBEPS_CP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/controlplane}"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)
# Start order; `down` stops in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
NUM_NODES=4
# Kubernetes' own gang scheduling (KEP-4671, alpha in 1.35/1.36): the PodGroup API (scheduling.k8s.io/v1alpha2) on the
# API server, the GangScheduling plugin in the scheduler's default profile, and the controller-manager's
# podgroup-protection controller, which removes a deleted PodGroup's finalizer once no running pod uses it (without
# it a deleted PodGroup stays forever). Flags only: the binaries are the same.
GANG_FEATURE_GATES="GenericWorkload=true,GangScheduling=true"

log() { printf '[controlplane] %s\n' "$*" >&2; }
die() { printf '[controlplane] error: %s\n' "$*" >&2; exit 1; }

# The required version of a module, read from go.mod (works for direct and indirect requires).
mod_version() {
  awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }
                 $1 == "require" && $2 == m { print $3; exit }' "$MOD_DIR/go.mod"
}

K8S_VERSION="$(mod_version k8s.io/kubernetes)"
ETCD_VERSION="$(mod_version go.etcd.io/etcd/server/v3)"
BIN="$CACHE_ROOT/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-kwok-${KWOK_VERSION}"

# The executable of a component.
exe_of() {
  if [[ "$1" == etcd && -n "${KUBEPS_CP_ETCD:-}" ]]; then
    readlink -f "$KUBEPS_CP_ETCD"
  else
    echo "$BIN/$1"
  fi
}

# find_go (and the other Go-module helpers)
# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

have_binaries() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

cmd_build() {
  if have_binaries; then
    log "binaries cached in $BIN"
    return 0
  fi
  local go jobs start
  go="$(find_go)" || die "Go is needed to build the control plane (tried \$GO, PATH, /usr/local/go/bin/go)"
  jobs="${KUBEPS_CP_BUILD_JOBS:-2}"
  mkdir -p "$BIN"
  # One build at a time per cache entry; a second caller waits and then finds the binaries.
  exec 8>"$BIN/.lock"
  flock 8
  if have_binaries; then log "binaries cached in $BIN"; return 0; fi
  start=$SECONDS
  local partial="$BIN/.partial"
  mkdir -p "$partial"
  export GOFLAGS=-trimpath CGO_ENABLED=0 GOMAXPROCS="$jobs" GOTOOLCHAIN=local
  log "building Kubernetes $K8S_VERSION and etcd $ETCD_VERSION with $("$go" version) (-p $jobs)"
  # Stamp the release into the binaries as Kubernetes' own build does, so /version and
  # `kubectl version` report it (helm checks a chart's kubeVersion against it).
  local minor x ldflags="-s -w" pkg
  minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for x in "gitVersion=$K8S_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
      "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
      ldflags+=" -X $pkg.$x"
    done
  done
  (cd "$MOD_DIR" && "$go" build -p "$jobs" -ldflags="$ldflags" -o "$partial/" tool ./cmd/etcd)
  log "building kwok $KWOK_VERSION"
  (cd "$partial" && GOBIN="$partial" "$go" install -p "$jobs" -ldflags='-s -w' \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION")
  local b
  for b in "${BINARIES[@]}"; do mv -f "$partial/$b" "$BIN/$b"; done
  rmdir "$partial" 2>/dev/null || true
  log "built in $((SECONDS - start)) s into $BIN"
}

# ---------------------------------------------------------------- helpers for up/down

pid_file() { echo "$STATE/pids/$1.pid"; }

# Alive and not a zombie: our daemons are reparented to PID 1, which may reap them late.
pid_running() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [[ "${stat%% *}" != Z ]]
}

# True when the PID recorded for component $1 is alive and still runs our binary.
component_alive() {
  local f pid exe
  f="$(pid_file "$1")"
  [[ -f "$f" ]] || return 1
  pid="$(<"$f")"
  [[ -n "$pid" ]] && pid_running "$pid" || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  [[ "$exe" == "$(exe_of "$1")" ]]
}

# A TCP port on 127.0.0.1 nobody listens on, below the ephemeral range so
# outgoing connections don't take it between now and our bind.
free_port() {
  local used p i
  used="$(ss -Htan 2>/dev/null | awk '{ n = split($4, a, ":"); print a[n] }' | sort -u)"
  for i in $(seq 1 200); do
    p=$((20000 + RANDOM % 12000))
    if ! grep -qx "$p" <<<"$used" && ! grep -qx "$p" <<<"${TAKEN_PORTS:-}"; then
      TAKEN_PORTS="${TAKEN_PORTS:-}"$'\n'"$p"
      echo "$p"
      return 0
    fi
    : "$i"
  done
  die "no free port found"
}

gen_certs() {
  local pki="$STATE/pki"
  [[ -f "$pki/.complete" ]] && return 0
  rm -rf "$pki"
  mkdir -p "$pki"
  (
    cd "$pki"
    umask 077
    local days=3650
    openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
    openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=kubeps-test-ca" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -out ca.crt 2>/dev/null
    # name, subject, extended key usage, subjectAltName (or empty)
    issue() {
      local name="$1" subj="$2" eku="$3" san="$4"
      openssl ecparam -name prime256v1 -genkey -noout -out "$name.key" 2>/dev/null
      openssl req -new -key "$name.key" -subj "$subj" -out "$name.csr" 2>/dev/null
      {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$eku"
        if [[ -n "$san" ]]; then echo "subjectAltName=$san"; fi
      } >"$name.ext"
      openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
        -days "$days" -extfile "$name.ext" -out "$name.crt" 2>/dev/null
      rm -f "$name.csr" "$name.ext"
    }
    issue apiserver "/CN=kube-apiserver" serverAuth \
      "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    issue admin "/O=system:masters/CN=kubeps-admin" clientAuth ""
    issue kube-controller-manager "/CN=system:kube-controller-manager" clientAuth ""
    issue kube-scheduler "/CN=system:kube-scheduler" clientAuth ""
    # kwok plays the kubelet of many nodes and writes node/pod status for all of them.
    issue kwok "/O=system:masters/CN=kwok" clientAuth ""
    # Service-account token signing key (RSA: accepted by every consumer of the tokens).
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    touch .complete
  )
}

write_kubeconfig() {
  local user="$1" port="$2" pki="$STATE/pki"
  cat >"$STATE/$user.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubeps
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority: $pki/ca.crt
users:
- name: $user
  user:
    client-certificate: $pki/$user.crt
    client-key: $pki/$user.key
contexts:
- name: kubeps
  context:
    cluster: kubeps
    user: $user
    namespace: default
current-context: kubeps
EOF
  chmod 600 "$STATE/$user.kubeconfig"
}

start_component() {
  local name="$1"
  shift
  # setsid: the component outlives the shell (and pytest) that ran `up`, until `down`.
  # 9>&-: the daemons must not inherit (and so hold forever) the lock of `up`.
  setsid "$(exe_of "$name")" "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null 9>&- &
  echo "$!" >"$(pid_file "$name")"
}

# wait_for SECONDS DESCRIPTION COMMAND...: retry COMMAND every 0.2 s.
wait_for() {
  local timeout="$1" what="$2" deadline
  shift 2
  deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${timeout}s waiting for $what"
      return 1
    fi
    sleep 0.2
  done
}

admin_curl() {
  curl -fsS --max-time 2 --cacert "$STATE/pki/ca.crt" --cert "$STATE/pki/admin.crt" \
    --key "$STATE/pki/admin.key" "https://127.0.0.1:$(<"$STATE/apiserver.port")$1"
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$STATE/admin.kubeconfig" "$@"; }

all_alive() {
  local c
  for c in "${COMPONENTS[@]}"; do component_alive "$c" || return 1; done
}

is_up() {
  [[ -f "$STATE/apiserver.port" ]] && all_alive && admin_curl /readyz >/dev/null
}

# shellcheck disable=SC2317  # reached through wait_for
nodes_ready() {
  local n
  n="$(kubectl_admin get nodes -l type=kwok \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    grep -cx True || true)"
  [[ "$n" -ge "$NUM_NODES" ]]
}

# shellcheck disable=SC2317  # reached through wait_for
default_sa_exists() { kubectl_admin -n default get serviceaccount default; }

fail_up() {
  local c
  log "$1"
  for c in "${COMPONENTS[@]}"; do
    if [[ -f "$STATE/logs/$c.log" ]]; then
      log "--- last lines of $STATE/logs/$c.log"
      tail -n 15 "$STATE/logs/$c.log" >&2 || true
    fi
  done
  stop_all
  exit 1
}

cmd_up() {
  have_binaries || die "control plane binaries missing in $BIN: run hack/controlplane.sh build (needs Go and the Go module proxy)"
  command -v openssl >/dev/null || die "openssl is needed (apt-get install -y openssl)"
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w 300 9 || die "another \`up\` or \`down\` holds $STATE/.lock"
  if is_up; then
    log "already up: $STATE"
    return 0
  fi
  # Leftovers from a crashed or half-started run: stop what we recorded, start clean.
  stop_all
  local start=$SECONDS
  mkdir -p "$STATE/pids" "$STATE/logs"
  rm -rf "$STATE/etcd"
  gen_certs

  TAKEN_PORTS=""
  local etcd_port etcd_peer_port api_port
  etcd_port="$(free_port)"
  etcd_peer_port="$(free_port)"
  api_port="$(free_port)"
  echo "$api_port" >"$STATE/apiserver.port"
  echo "$etcd_port" >"$STATE/etcd.port"
  local u
  for u in admin kube-controller-manager kube-scheduler kwok; do write_kubeconfig "$u" "$api_port"; done
  local pki="$STATE/pki"

  start_component etcd \
    --name kubeps --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "kubeps=http://127.0.0.1:$etcd_peer_port" \
    --unsafe-no-fsync --quota-backend-bytes=4294967296 --log-level=warn
  wait_for 30 "etcd health" curl -fsS --max-time 1 "http://127.0.0.1:$etcd_port/health" ||
    fail_up "etcd did not become healthy"

  # The advertise address only fills the `kubernetes` Service's endpoints, which may
  # not be loopback; 192.0.2.1 (TEST-NET-1) is never dialled, clients use 127.0.0.1.
  start_component kube-apiserver \
    --bind-address=127.0.0.1 --advertise-address=192.0.2.1 --secure-port="$api_port" \
    --etcd-servers="http://127.0.0.1:$etcd_port" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" \
    --service-cluster-ip-range=10.96.0.0/16 \
    --allow-privileged=true --profiling=false \
    --feature-gates="$GANG_FEATURE_GATES" --runtime-config=scheduling.k8s.io/v1alpha2=true \
    --event-ttl=1h
  wait_for 90 "kube-apiserver /readyz" admin_curl /readyz ||
    fail_up "kube-apiserver did not become ready"

  start_component kube-controller-manager \
    --kubeconfig="$STATE/kube-controller-manager.kubeconfig" \
    --secure-port=0 --leader-elect=false \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" \
    --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --controllers='*' --profiling=false \
    --feature-gates="$GANG_FEATURE_GATES"
  start_component kube-scheduler \
    --kubeconfig="$STATE/kube-scheduler.kubeconfig" \
    --feature-gates="$GANG_FEATURE_GATES" \
    --secure-port=0 --leader-elect=false --profiling=false
  start_component kwok \
    --kubeconfig="$STATE/kwok.kubeconfig" \
    --config="$MOD_DIR/kwok.yaml" \
    --manage-all-nodes=false \
    --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake

  kubectl_admin apply -f "$MOD_DIR/nodes.yaml" >/dev/null || fail_up "could not create the fake nodes"
  wait_for 60 "$NUM_NODES kwok nodes Ready" nodes_ready || fail_up "kwok nodes did not become Ready"
  wait_for 60 "the default service account (controller-manager)" default_sa_exists ||
    fail_up "kube-controller-manager did not create the default service account"
  all_alive || fail_up "a component exited during start-up"
  start_watchdog
  log "up in $((SECONDS - start)) s: API server https://127.0.0.1:$api_port, state in $STATE"
}

WATCHDOG_TAG=kubeps-cp-watchdog

start_watchdog() {
  local parent="${KUBEPS_CP_WATCH_PID:-}"
  [[ -n "$parent" ]] || return 0
  # $0 of the watchdog shell is the tag, so `down` can tell it is ours before killing it.
  # shellcheck disable=SC2016  # expanded by the watchdog shell, not here
  setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done; exec "$2" down' \
    "$WATCHDOG_TAG" "$parent" "$ROOT/controlplane.sh" >>"$STATE/logs/watchdog.log" 2>&1 </dev/null 9>&- &
  echo "$!" >"$(pid_file watchdog)"
}

stop_watchdog() {
  local f pid
  f="$(pid_file watchdog)"
  [[ -f "$f" ]] || return 0
  pid="$(<"$f")"
  rm -f "$f"
  # Not ourselves (the watchdog execs `down`), and only if it still is the watchdog.
  if [[ "$pid" != "$$" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "^bash -c .* $WATCHDOG_TAG "; then
    kill -TERM "$pid" 2>/dev/null || true
  fi
}

# TERM the given components together, wait for them to exit, KILL after 15 s.
stop_components() {
  local c f pid
  local -a pids=()
  for c in "$@"; do
    f="$(pid_file "$c")"
    [[ -f "$f" ]] || continue
    if component_alive "$c"; then
      pid="$(<"$f")"
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
    rm -f "$f"
  done
  local deadline=$((SECONDS + 15))
  for pid in "${pids[@]}"; do
    while pid_running "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    if pid_running "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
}

# Clients of the API server first, then the API server, then its storage, so nobody
# waits on a dependency that is already gone.
stop_all() {
  stop_watchdog
  stop_components kwok kube-scheduler kube-controller-manager
  stop_components kube-apiserver
  stop_components etcd
}

cmd_down() {
  [[ -d "$STATE" ]] || { log "nothing to stop ($STATE does not exist)"; return 0; }
  exec 9>"$STATE/.lock"
  flock -w 60 9 || log "state dir locked for 60 s; stopping the recorded processes anyway"
  stop_all
  rm -rf "$STATE/etcd" "$STATE/apiserver.port" "$STATE/etcd.port"
  log "down ($STATE)"
  # A throw-away state dir (the test fixture's) goes entirely, also when the watchdog stops it.
  if [[ -f "$STATE/.ephemeral" ]]; then rm -rf "$STATE"; fi
}

cmd_env() {
  echo "export KUBECONFIG=$STATE/admin.kubeconfig"
  echo "export KUBEPS_CP_BIN=$BIN"
}

cmd_status() {
  local c pid rss total=0
  for c in "${COMPONENTS[@]}"; do
    if component_alive "$c"; then
      pid="$(<"$(pid_file "$c")")"
      rss="$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status")"
      total=$((total + rss))
      printf '%-24s pid %-8s rss %6d MiB\n' "$c" "$pid" "$((rss / 1024))"
    else
      printf '%-24s not running\n' "$c"
    fi
  done
  printf '%-24s %18s %6d MiB\n' total "" "$((total / 1024))"
  if is_up; then echo "up: $STATE"; else echo "not up: $STATE"; return 1; fi
}

main() {
  case "${1:-}" in
    build) cmd_build ;;
    up) cmd_up ;;
    down) cmd_down ;;
    env) cmd_env ;;
    status) cmd_status ;;
    bin-dir) echo "$BIN" ;;
    *)
      echo "usage: $0 {build|up|down|env|status|bin-dir}" >&2
      exit 2
      ;;
  esac
}

# One line, read whole before it runs: a script edited (or checked out) while `build` or
# `up` is running does not make bash read the rest of a changed file.
main "$@"; exit
