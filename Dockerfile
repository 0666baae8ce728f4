# kv-router: KV-cache-aware request router, served over HTTP by `kv-router serve`.
#
# Build:  docker build -t kv-router .
# Run:    docker run --rm -p 8000:8000 kv-router
#         (every setting is a KV_ROUTER_* variable: -e KV_ROUTER_BLOCK_SIZE=64, ...)

# --- build stage: a wheel of the project and of every runtime dependency ------------------------
FROM python:3.11-slim AS build
WORKDIR /src
# Manifest first, so editing code does not invalidate the dependency layer.
COPY pyproject.toml README.md ./
COPY indexer ./indexer
COPY router ./router
COPY api ./api
COPY mocker ./mocker
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# --- runtime stage: the wheels installed into a clean slim image, run as an unprivileged user ---
FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KV_ROUTER_HOST=0.0.0.0 \
    KV_ROUTER_PORT=8000 \
    KV_ROUTER_LOG_FORMAT=json
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels kv-router \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvrouter
USER 10001
EXPOSE 8000
# The slim image has no curl: probe with the Python that runs the service.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KV_ROUTER_PORT', '8000'), timeout=2)"]
# SIGTERM lets in-flight requests finish (KV_ROUTER_SHUTDOWN_TIMEOUT_SECS) before the process exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kv-router", "serve"]
