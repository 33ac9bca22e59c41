#!/usr/bin/env bash
# Build the voxrecall image with podman on a Debian bookworm host that has no Docker engine, and,
# with --smoke, run it once: health over gRPC from the host, then SIGTERM and exit status 0.
#
# What it does, as root (it says so before each step):
#   apt-get install podman runc debootstrap (and what podman needs: slirp4netns, fuse-overlayfs,
#     uidmap, containernetworking-plugins, iptables)
#   writes a containers.conf: runc, cgroupfs, explicit nofile/nproc ulimits (the defaults podman
#     derives from a container host's limits are refused by runc here)
#   makes the base image the Dockerfile's FROM names, locally: debootstrap a minimal bookworm with
#     python3 (3.11), venv, pip and the headers, then `podman import` it under that name; the build
#     runs with --pull=never, so nothing comes from a registry
#   builds with the host's CA bundle handed to pip as a build secret (not kept in the image)
#
#   deploy/build-image.sh                 # build voxrecall:latest
#   deploy/build-image.sh --smoke         # build, then start it against examples/, check, SIGTERM it
#   deploy/build-image.sh --print-mirror  # the Debian mirror debootstrap would use, and exit
# Environment: IMAGE (voxrecall:latest), WORK (/var/tmp/voxrecall-image), CA_BUNDLE, MIRROR (the
# Debian mirror for debootstrap; default: the host's own apt sources for bookworm, read from
# APT_ETC, /etc/apt).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/voxrecall:latest}
BASE=docker.io/library/python:3.11-slim-bookworm # the Dockerfile's FROM, fully qualified
SUITE=bookworm
WORK=${WORK:-/var/tmp/voxrecall-image}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
APT_ETC=${APT_ETC:-/etc/apt}
SMOKE=0
case ${1:-} in
  "") ;;
  --smoke) SMOKE=1 ;;
  --print-mirror) ;;
  *) echo "usage: deploy/build-image.sh [--smoke | --print-mirror]" >&2; exit 2 ;;
esac

say() { printf '\n== %s\n' "$*" >&2; }

# The mirror the host's apt fetches $SUITE from: deb822 *.sources (Types: deb, Suites: $SUITE,
# URIs:) first, then one-line `deb [options] URI $SUITE ...` entries. Prints nothing if none.
host_mirror() {
  local f
  for f in "$APT_ETC"/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk -v suite="$SUITE" '
      function reset() { deb = hit = 0; enabled = 1; uri = "" }
      function flush() { if (deb && hit && enabled && uri != "") { print uri; done = 1; exit } reset() }
      BEGIN { reset() }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]*#/ { next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      tolower($1) == "uris:" { uri = $2 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) hit = 1 }
      tolower($1) == "enabled:" { enabled = tolower($2) != "no" }
      END { if (!done) flush() }' "$f"
  done
  for f in "$APT_ETC"/sources.list "$APT_ETC"/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    awk -v suite="$SUITE" '$1 == "deb" {
      i = 2
      if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
      if ($(i + 1) == suite) { print $i; exit }
    }' "$f"
  done
}
MIRROR=${MIRROR:-$(host_mirror | head -n 1)}
if [[ ${1:-} == --print-mirror ]]; then
  [[ -n $MIRROR ]] && echo "$MIRROR" && exit 0
fi
if [[ -z $MIRROR ]]; then
  echo "no $SUITE mirror in the host's apt sources ($APT_ETC): name one, e.g." >&2
  echo "  MIRROR=<your Debian mirror URL, ending in /debian> deploy/build-image.sh" >&2
  exit 2
fi

# --smoke builds the example snapshot and asks the container with the README's dev venv.
if ((SMOKE)) && ! [[ -x .venv/bin/voxrecall && -x .venv/bin/grpcurl ]]; then
  echo "--smoke needs the README's dev venv (voxrecall and grpcurl); make it first:" >&2
  echo "  python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]'" >&2
  exit 2
fi

[[ $(id -u) == 0 ]] || { echo "run as root: it installs packages and runs podman rootful" >&2; exit 1; }
mkdir -p "$WORK"

say "installing podman, runc, debootstrap (apt-get)"
need=()
for pkg in podman runc debootstrap slirp4netns fuse-overlayfs uidmap containernetworking-plugins iptables; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
done
if ((${#need[@]})); then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# runc cannot raise a limit above what the host allows it (no CAP_SYS_RESOURCE here), and
# podman's defaults (nofile 1048576) are above that: nofile is the host's hard limit, and nproc
# 4096 is far more threads than a sidecar starts (the host's own hard nproc is refused too).
NOFILE=$(ulimit -Hn)
NPROC=4096
say "writing $WORK/containers.conf (runc, cgroupfs, ulimits nofile=$NOFILE nproc=$NPROC)"
cat >"$WORK/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$WORK/containers.conf"
pm() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }

if pm image exists "$BASE"; then
  say "base image $BASE already present"
else
  say "debootstrap a minimal bookworm into $WORK/rootfs"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,python-is-python3,ca-certificates \
    "$SUITE" "$WORK/rootfs" "$MIRROR"
  chroot "$WORK/rootfs" apt-get clean
  rm -rf "$WORK/rootfs"/var/lib/apt/lists/* "$WORK/rootfs"/var/cache/apt/*.bin
  say "podman import as $BASE"
  tar -C "$WORK/rootfs" -c . | pm import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$BASE"
fi

say "podman build $IMAGE (--pull=never, CA bundle as a build secret)"
pm build --pull=never --format docker --network host \
  --secret "id=ca,src=$CA_BUNDLE" -t "$IMAGE" -f Dockerfile .
pm image inspect "$IMAGE" --format 'image {{.Id}} {{.Size}} bytes, user {{.Config.User}}'

((SMOKE)) || exit 0

say "smoke: build the example snapshot on the host, start the image, health, SIGTERM"
.venv/bin/voxrecall index build --config examples/voxrecall.toml
# The image runs as uid 10001; the store is mounted as the build left it (published versions
# are readable by every user), as the README tells users to.
PORT=${PORT:-50151}
pm rm -f voxrecall-smoke >/dev/null 2>&1 || true
pm run -d --name voxrecall-smoke -p "127.0.0.1:$PORT:50051" \
  -v "$PWD/examples:/config:ro" -v "$PWD/var/store:/store:ro" "$IMAGE"
status=""
for _ in $(seq 60); do
  status=$(.venv/bin/grpcurl -plaintext "127.0.0.1:$PORT" grpc.health.v1.Health/Check 2>/dev/null || true)
  grep -q '"SERVING"' <<<"$status" && break
  sleep 1
done
echo "grpcurl health from the host: $status"
grep -q '"SERVING"' <<<"$status" || { pm logs voxrecall-smoke 2>&1 | tail -20; exit 1; }
.venv/bin/grpcurl -plaintext -d '{"text": "How do I reset my password?", "is_final": true}' \
  "127.0.0.1:$PORT" voxrecall.v1.Retrieval/Turn | grep -m3 -E '"title"|"snapshotVersion"'
# podman runs HEALTHCHECKs from systemd timers, absent here: run the image's probe by hand
pm healthcheck run voxrecall-smoke && echo "image HEALTHCHECK: healthy"
pm exec voxrecall-smoke id -u
pm stop --time 30 voxrecall-smoke # SIGTERM; SIGKILL only after 30 s
code=$(pm inspect voxrecall-smoke --format '{{.State.ExitCode}}')
pm logs voxrecall-smoke 2>&1 | tail -4
pm rm voxrecall-smoke >/dev/null
echo "exit status after SIGTERM: $code"
[[ $code == 0 ]]
