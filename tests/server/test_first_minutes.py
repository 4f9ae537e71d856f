"""A new user's first minutes with ``ferry``: mistakes are one line at once, never a
traceback, and the help says what it does by default. Real ``ferry`` processes."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import time

import pytest
from conftest import ROOT
from helpers import ferry_command


def ferry(*argv: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ferry_command(), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)  # fmt: skip


def test_a_taken_port_fails_at_once_before_any_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        run = ferry("serve", "--port", str(port))  # the default model: seconds to load
        took = time.monotonic() - started
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert out.strip().splitlines() == [out.strip()], out  # one line
    assert "cannot listen" in out and "Address already in use" in out
    assert "is another ferry serve running? (--port picks another port, 0 a free one)" in out
    assert "ferry: starting" not in out and "worker" not in out  # no worker was started
    assert took < 20


@pytest.mark.parametrize("model, reason", [
    ("/nonexistent/model.gguf", "no such file or folder"),
    ("dummy:no-such-preset", "unknown dummy preset"),
    ("{not_gguf}", "is not a GGUF file"),
])  # fmt: skip
def test_a_bad_model_fails_with_one_line(model, reason, tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("these are not weights")
    model = model.format(not_gguf=not_gguf)
    run = ferry("serve", "--port", "0", "--model", model)
    assert run.returncode == 1
    assert run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"ferry: --model {model}: ") and reason in line


def test_a_worker_with_a_bad_model_fails_with_one_line():
    run = ferry("worker", "--role", "decode", "--model", "/nonexistent", "--cluster-secret", "s")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == ["ferry: --model /nonexistent: model "
                                               "'/nonexistent': no such file or folder"]


def test_an_unknown_flag_prints_the_subcommands_usage_not_the_top_level():
    run = ferry("serve", "--bogus")
    assert run.returncode == 2
    lines = run.stderr.splitlines()
    assert lines[0].startswith("usage: ferry serve ")
    assert lines[-1] == ("ferry serve: error: unrecognized arguments: --bogus "
                         "(see ferry serve --help)")
    assert len(lines) == 2
    worker = ferry("worker", "--role", "prefill", "--bogus").stderr.splitlines()
    assert worker[0].startswith("usage: ferry worker ")


def test_a_bad_value_names_the_flag():
    run = ferry("serve", "--prefill", "many")
    assert run.returncode == 2 and "argument --prefill: invalid int value: 'many'" in run.stderr
    assert len(run.stderr.splitlines()) == 2


@pytest.mark.parametrize("argv, error", [
    (["serve", "--port", "99999"], "argument --port: must be 0-65535, got 99999"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, got 0"),
    (["serve", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["serve", "--kv-cache-memory-gb", "0"], "argument --kv-cache-memory-gb: must be more than 0"),
    (["worker", "--role", "decode", "--block-size", "0"], "argument --block-size: must be at "
                                                          "least 1, got 0"),
    (["bench", "--url", "http://h", "--rate", "1", "--num-requests", "0"],
     "argument --num-requests: must be at least 1, got 0"),
])  # fmt: skip
def test_a_value_the_workers_would_refuse_is_refused_at_once(argv, error):
    started = time.monotonic()
    run = ferry(*argv)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    usage, line = run.stderr.splitlines()
    assert usage.startswith(f"usage: ferry {argv[0]} ") and error in line, line
    assert time.monotonic() - started < 10  # the parser alone: no model, no worker


def test_a_host_that_is_no_address_is_one_line_suggesting_one():
    run = ferry("serve", "--host", "999.1.1.1")
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "ferry: cannot listen on 999.1.1.1:8000: --host 999.1.1.1 is neither an address nor a "
        "name this machine resolves (--host 127.0.0.1 listens on this machine only, 0.0.0.0 on "
        "every interface)"]


def test_no_gpu_is_said_before_anything_starts():
    run = ferry("serve", "--port", "0", "--device", "cuda",
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert run.returncode == 1 and run.stdout == ""  # no "ferry: starting ..." line
    assert run.stderr.splitlines() == ["ferry: --device cuda, but no GPU is visible (--device "
                                       "cpu runs on the CPU)"]


def test_version_is_the_installed_packages():
    run = ferry("--version")
    assert run.returncode == 0
    assert run.stdout.strip() == f"ferry {importlib.metadata.version('ferry')}"


def test_help_shows_the_defaults():
    text = " ".join(ferry("serve", "--help").stdout.split("options:", 1)[1].split())
    for flag, default in [("--port PORT", "8000"), ("--host HOST", "127.0.0.1"),
                          ("--max-num-seqs MAX_NUM_SEQS", "64"), ("--prefill N", "1"),
                          ("--router-policy", "cache_aware"), ("--kv-file-ttl-hours", "72.0"),
                          ("--model PATH", "default"), ("--drain-timeout S", "30.0")]:  # fmt: skip
        start = text.index(flag)
        end = text.find(" --", start + len(flag))
        assert f"(default: {default}" in text[start:end], text[start:end]
    worker = " ".join(ferry("worker", "--help").stdout.split())
    assert "(default: tcp://127.0.0.1:0)" in worker


def test_ctrl_c_while_the_workers_start_stops_everything_with_one_line(tmp_path):
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*ferry_command(), "serve", "--port", "0", "--threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "ferry: starting" not in log_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # the workers are importing and loading the model
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=40) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log_path.read_text()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1] == "ferry: stopped while starting", out
