"""``--config topo.yaml``: the file fills the same config fields its flags fill, the
command line overrides it, each command takes its own keys, and a mistake names the file
and the key."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from conftest import ROOT
from helpers import ferry_command

from server import serve
from server.cli import build_parser, commands, with_topology

TOPOLOGY = {
    "model": {"model": "dummy:tiny", "device": "cpu", "max_model_len": 512},
    "engine": {"max-num-seqs": 8, "overlap-scheduling": False},
    "server": {"host": "0.0.0.0", "port": 9000, "max-queued-requests": 12},
    "control": {"redis": "redis://redis.internal:6379/0"},
    "pools": {"prefill": 2, "decode": 3, "router-policy": "round_robin"},
    "transfer": {"kv-transport": "tcp", "kv-transfer-timeout": 30},
    "tiers": {"kv-tiers": ["host", "file"], "kv-dir": "/var/kv", "kv-file-ttl-hours": 6},
    "log": {"log-format": "json"},
    "worker": {"frontend": ["http://a:8001", "http://b:8001"]},
}


def parse(*argv: str):
    parser = build_parser()
    return parser.parse_args(with_topology(list(argv), commands(parser)))


@pytest.fixture
def topo(tmp_path):
    def write(data: dict) -> str:
        path = tmp_path / "topo.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return write


def test_the_file_fills_the_fields_its_flags_fill(topo):
    path = topo(TOPOLOGY)
    from_file = parse("serve", "--config", path)
    flags = parse("serve", "--model", "dummy:tiny", "--device", "cpu", "--max-model-len",
                  "512", "--max-num-seqs", "8", "--no-overlap-scheduling", "--host", "0.0.0.0",
                  "--port", "9000", "--max-queued-requests", "12", "--redis",
                  "redis://redis.internal:6379/0", "--prefill", "2", "--decode", "3",
                  "--router-policy", "round_robin", "--kv-transport", "tcp",
                  "--kv-transfer-timeout", "30", "--kv-tiers", "host,file", "--kv-dir",
                  "/var/kv", "--kv-file-ttl-hours", "6", "--log-format", "json")  # fmt: skip
    for build in (serve.engine_config, serve.pd_config, serve.server_config, serve.log_config):
        assert build(from_file) == build(flags)
    assert serve.pd_config(from_file).transfer.transport == "tcp"
    assert serve.engine_config(from_file).scheduler.max_num_seqs == 8


def test_the_command_line_overrides_the_file(topo):
    path = topo(TOPOLOGY)
    args = parse("serve", "--config", path, "--port", "9100", "--decode", "1")
    assert serve.server_config(args).port == 9100
    assert (serve.pd_config(args).num_prefill, serve.pd_config(args).num_decode) == (2, 1)


def test_a_worker_takes_its_own_keys_and_leaves_the_frontends(topo):
    path = topo({**TOPOLOGY, "worker": {**TOPOLOGY["worker"], "role": "decode"}})
    args = parse("worker", "--config", path, "--frontend", "http://c:8001")
    assert args.role == "decode" and args.redis == "redis://redis.internal:6379/0"
    assert args.frontend == ["http://a:8001", "http://b:8001", "http://c:8001"]
    assert serve.transfer_config(args).transport == "tcp"
    assert not hasattr(args, "prefill")  # a frontend's key, left alone


@pytest.mark.parametrize("data, problem", [
    ({"pool": {"prefill": 1}}, "unknown section 'pool'"),
    ({"pools": {"prefil": 1}}, "section 'pools' has no key 'prefil'"),
    ({"control": {"cluster-secret": "s3cret"}}, "keep secrets out of files; give "
     "$FERRY_CLUSTER_SECRET"),
    ({"server": {"api-key": "k"}}, "give $FERRY_API_KEY"),
    ({"pools": {"aggregated": "yes"}}, "pools.aggregated: expected true or false"),
    ({"pools": {"prefill": True}}, "pools.prefill: expected a value"),
    ({"pools": 3}, "section 'pools' must hold keys"),
    ({"pools": {"prefill": "x"}}, "pools.prefill: argument --prefill: invalid int value: 'x'"),
    ({"server": {"port": 99999}}, "server.port: argument --port: must be 0-65535, got 99999"),
    ({"engine": {"max_num_seqs": 0}}, "engine.max-num-seqs: argument --max-num-seqs: must be at "
                                      "least 1, got 0"),
    ({"model": {"dtype": "int3"}}, "model.dtype: argument --dtype: invalid choice: 'int3'"),
])  # fmt: skip
def test_a_mistake_in_the_file_is_one_line_naming_it(topo, data, problem):
    path = topo(data)
    run = subprocess.run([*ferry_command(), "serve", "--config", path], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    error = run.stderr.splitlines()[-1]
    assert problem in error and len(run.stderr.splitlines()) == 2
    assert path in error


def test_a_missing_or_broken_file_is_one_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [prefill: 1\n")
    for path, problem in ((tmp_path / "none.yaml", "No such file"), (broken, "not valid YAML")):
        run = subprocess.run([*ferry_command(), "serve", "--config", str(path)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert run.returncode == 2 and problem in run.stderr.splitlines()[-1], run.stderr
