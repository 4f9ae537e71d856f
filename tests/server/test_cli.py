"""``ferry serve`` flags → frozen configs; the subcommand registry; TCP_NODELAY on sockets."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import socket

import pytest
import uvicorn

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from server import cli, serve
from server.cli import SUBCOMMANDS, build_parser, commands


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_come_from_the_config_dataclasses(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_KV_DIR", str(tmp_path))
    args = parse()
    # serve's own: the tiers (on the CPU the file tier alone) and, on the CPU, a context
    # of CPU_MAX_MODEL_LEN
    tiers = CacheConfig(kv_dir=str(tmp_path))
    scheduler = SchedulerConfig(max_model_len=serve.CPU_MAX_MODEL_LEN)
    expected = EngineConfig(model="default", cache=tiers, scheduler=scheduler)
    assert serve.engine_config(args) == expected
    config = serve.server_config(args)
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None)


def test_flags_build_a_frozen_engine_config():
    args = parse(
        "--model", "dummy:tiny", "--max-model-len", "512", "--block-size", "32",
        "--kv-cache-memory-gb", "0.5", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--seed", "3", "--threads", "2", "--served-model-name", "tiny",
    )  # fmt: skip
    config = serve.engine_config(args)
    assert config.model == "dummy:tiny" and config.seed == 3 and config.num_threads == 2
    assert (config.cache.block_size, config.cache.memory_gb) == (32, 0.5)
    assert config.scheduler.max_model_len == 512
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 4  # type: ignore[misc]
    assert serve.server_config(args).served_model_name == "tiny"


def test_cuda_defaults_to_large_blocks_and_overlap_the_cpu_does_not():
    cpu = serve.engine_config(parse())
    assert cpu.cache.block_size == CacheConfig.block_size and not cpu.overlaps
    gpu = serve.engine_config(parse("--device", "cuda:1"))
    assert gpu.cache.block_size == serve.CUDA_BLOCK_SIZE and gpu.overlaps
    chosen = serve.engine_config(
        parse("--device", "cuda", "--block-size", "16", "--no-overlap-scheduling")
    )
    assert chosen.cache.block_size == 16 and not chosen.overlaps
    assert serve.engine_config(parse("--overlap-scheduling")).overlaps


def test_cuda_keeps_kv_in_host_memory_and_uses_files_only_when_given_a_directory(tmp_path):
    cpu = serve.engine_config(parse()).cache
    assert cpu.host_memory_gb == 0.0 and cpu.kv_dir  # the cache is host memory already
    gpu = serve.engine_config(parse("--device", "cuda")).cache
    assert gpu.host_memory_gb == pytest.approx(serve.host_tier_gb(parse()), rel=0.05)
    assert gpu.host_memory_gb > 0 and gpu.kv_dir == ""
    given = serve.engine_config(parse("--device", "cuda", "--kv-dir", str(tmp_path))).cache
    assert given.kv_dir == str(tmp_path)
    forced = serve.engine_config(parse("--device", "cuda", "--kv-tiers", "host,file")).cache
    assert forced.kv_dir


def test_kv_transport_defaults_to_one_the_device_can_use(monkeypatch):
    import torch

    assert serve.pd_config(parse()).transfer.transport == "shm"  # shared CPU memory
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert serve.pd_config(parse("--device", "cuda")).transfer.transport == "cuda_ipc"
    assert serve.pd_config(parse("--device", "cuda:0")).transfer.transport == "cuda_ipc"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # spread over two GPUs
    assert serve.pd_config(parse("--device", "cuda")).transfer.transport == "nccl"
    tcp = serve.pd_config(parse("--device", "cuda", "--kv-transport", "tcp"))
    assert tcp.transfer.transport == "tcp"


def test_kv_tier_flags(monkeypatch, tmp_path):
    monkeypatch.delenv("FERRY_KV_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = serve.engine_config(parse()).cache
    assert cache.kv_dir == str(tmp_path / "ferry" / "kv")  # the user's cache directory
    cache = serve.engine_config(parse(
        "--kv-tiers", "file", "--kv-dir", str(tmp_path / "kv"), "--kv-file-ttl-hours", "2",
        "--kv-file-capacity-gb", "0.5",
    )).cache  # fmt: skip
    assert (cache.host_memory_gb, cache.kv_dir) == (0.0, str(tmp_path / "kv"))
    assert (cache.file_ttl_hours, cache.file_capacity_gb) == (2.0, 0.5)
    cache = serve.engine_config(parse("--kv-tiers", "none", "--host-kv-cache-gb", "1")).cache
    assert (cache.host_memory_gb, cache.kv_dir) == (0.0, "")
    assert serve.engine_config(parse("--kv-tiers", "host")).cache.host_memory_gb > 0
    assert serve.engine_config(parse()).cache.file_mode == 0o600  # the owner only
    for text in ("640", "0640", "0o640"):
        assert serve.engine_config(parse("--kv-file-mode", text)).cache.file_mode == 0o640


def test_body_and_generation_bounds():
    config = serve.server_config(parse())
    assert (config.max_body_mb, config.max_tokens_limit) == (32.0, None)
    config = serve.server_config(parse("--max-body-mb", "2", "--max-tokens-limit", "4"))
    assert (config.max_body_mb, config.max_tokens_limit) == (2.0, 4)


@pytest.mark.parametrize("argv", [
    ["--kv-tiers", "gpu"], ["--kv-tiers", ""], ["--host-kv-cache-gb", "-1"],
    ["--kv-file-ttl-hours", "0"], ["--kv-file-capacity-gb", "nan"],
    ["--kv-file-mode", "400"], ["--kv-file-mode", "1600"], ["--kv-file-mode", "rw"],
    ["--max-tokens-limit", "0"], ["--max-body-mb", "0"],
])  # fmt: skip
def test_bad_kv_tier_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "argument --" in capsys.readouterr().err


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("FERRY_API_KEY", "from-env")
    assert serve.server_config(parse()).api_key == "from-env"
    assert serve.server_config(parse("--api-key", "flag")).api_key == "flag"
    monkeypatch.delenv("FERRY_API_KEY")
    assert serve.server_config(parse()).api_key is None


def test_api_flags_reach_the_server_config(capsys):
    default = serve.server_config(parse())
    assert (default.max_tokens_default, default.response_store_size) == (2048, 1000)
    given = serve.server_config(parse("--max-tokens-default", "0", "--response-store-size",
                                      "5", "--response-store-ttl", "60"))  # fmt: skip
    assert (given.max_tokens_default, given.response_store_size) == (0, 5)
    assert given.response_store_ttl_s == 60.0
    with pytest.raises(SystemExit):
        parse("--max-tokens-default", "-1")
    assert "--max-tokens-default" in capsys.readouterr().err


MINIMAL_ARGS = {
    "bench": ["--url", "http://127.0.0.1:1", "--concurrency", "1"],
    "worker": ["--role", "decode"],
}


def test_every_registered_subcommand_parses():
    parser = build_parser()
    for name in SUBCOMMANDS:
        assert callable(parser.parse_args([name, *MINIMAL_ARGS.get(name, [])]).run)


async def test_uvicorn_sockets_have_tcp_nodelay():
    """Small SSE chunks must not wait for Nagle: asyncio sets TCP_NODELAY on accepted sockets."""
    seen: list[int] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await reader.readuntil(b"ok")
    for connection in server.server_state.connections:
        sock = connection.transport.get_extra_info("socket")
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    writer.close()
    server.should_exit = True
    await task
    assert seen and all(seen)


def test_fp8_quantization_reaches_the_engine_and_is_refused_for_a_model_without_experts(capsys):
    assert serve.engine_config(parse()).quantization == "none"
    assert serve.engine_config(parse("--quantization", "fp8")).quantization == "fp8"
    with pytest.raises(SystemExit, match="has none"):  # a dense model: nothing to quantize
        serve.run(parse("--quantization", "fp8", "--model", "dummy:tiny"))
    with pytest.raises(SystemExit, match="--dtype bfloat16"):  # float32 on CUDA
        serve.run(parse("--quantization", "fp8", "--model", "dummy:deepseek-v3-tiny",
                        "--device", "cuda"))
    assert serve.pd_config(parse("--quantization", "fp8", "--decode-ep", "2")).decode_ep == 2
    with pytest.raises(SystemExit):
        parse("--quantization", "int3")
    assert "--quantization" in capsys.readouterr().err


@pytest.mark.parametrize("argv, error", [
    (["--port", "99999"], "argument --port: must be 0-65535, got 99999"),
    (["--port", "-5"], "argument --port: must be 0-65535, got -5"),
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--internal-port", "70000"], "argument --internal-port: must be 0-65535, got 70000"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, got 0"),
    (["--max-num-seqs", "-1"], "argument --max-num-seqs: must be at least 1, got -1"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be at least 1"),
    (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3' (choose from 'float32', "
                          "'bfloat16', 'float16')"),
    (["--device", "gpu"], "argument --device: cpu, cuda or cuda:N, not 'gpu'"),
    (["--device", "cuda:x"], "argument --device: cpu, cuda or cuda:N, not 'cuda:x'"),
    (["--max-model-len", "0"], "argument --max-model-len: must be at least 1, got 0"),
    (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
    (["--kv-cache-memory-gb", "0"], "argument --kv-cache-memory-gb: must be more than 0, got 0"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--seed", str(2**63)], "argument --seed: must be from -9223372036854775808 to "
                             "9223372036854775807"),
    (["--grammar-cache-mb", "-1"], "argument --grammar-cache-mb: must be at least 0, got -1"),
    (["--grammar-compile-threads", "0"], "argument --grammar-compile-threads: must be at least 1"),
    (["--speculative", "eagle"], "argument --speculative: ngram, mtp, draft:PATH or none, "
                                 "not 'eagle'"),
    (["--speculative", "draft:"], "argument --speculative: ngram, mtp, draft:PATH or none"),
    (["--num-speculative-tokens", "17"], "argument --num-speculative-tokens: must be 0-16, got 17"),
    (["--spec-confidence-temperatures", "1,0"], "argument --spec-confidence-temperatures: "
                                                "comma-separated numbers above 0"),
    (["--prefill", "-1"], "argument --prefill: must be at least 0, got -1"),
    (["--decode", "-1"], "argument --decode: must be at least 0, got -1"),
    (["--encode", "-1"], "argument --encode: must be at least 0, got -1"),
    (["--worker-silence-timeout", "nan"], "argument --worker-silence-timeout: must be a finite "
                                          "number more than 0, got nan"),
    (["--local-prefill-tokens", "-1"], "argument --local-prefill-tokens: must be at least 0"),
    (["--kv-transfer-timeout", "0"], "argument --kv-transfer-timeout: must be more than 0, got 0"),
    (["--kv-queue-timeout", "-1"], "argument --kv-queue-timeout: must be at least 0, got -1"),
    (["--request-timeout", "inf"], "argument --request-timeout: must be a finite number at "
                                   "least 0, got inf"),
])  # fmt: skip
def test_a_bad_value_is_refused_when_parsed_naming_the_flag(argv, error, capsys):
    with pytest.raises(SystemExit) as exit:
        parse(*argv)
    assert exit.value.code == 2
    assert error in capsys.readouterr().err.splitlines()[-1]


def test_every_numeric_flag_checks_its_range():
    """No flag of a ferry command takes any int or float: each has a type that says which
    (``server.cli``: int_in, positive_number, ...), so a bad value is refused when parsed."""
    unbounded = {"--seed", "--image-seed"}  # any integer seeds a random.Random
    parser = build_parser()
    for name, command in commands(parser).items():
        for action in command._actions:
            if action.help == argparse.SUPPRESS or unbounded & set(action.option_strings):
                continue
            assert action.type not in (int, float), (name, action.option_strings)


def test_valid_values_parse_as_before():
    args = parse("--port", "0", "--internal-port", "65535", "--log-level", "DEBUG",
                 "--device", "cuda:1", "--dtype", "bfloat16", "--speculative", "draft:/m",
                 "--num-speculative-tokens", "16", "--seed", "-1", "--block-size", "7",
                 "--prefill", "0", "--decode", "0", "--kv-queue-timeout", "0")  # fmt: skip
    assert (args.port, args.internal_port, args.log_level) == (0, 65535, "debug")
    assert (args.device, args.dtype, args.speculative) == ("cuda:1", "bfloat16", "draft:/m")
    assert (args.seed, args.block_size, args.prefill, args.kv_queue_timeout) == (-1, 7, 0, 0.0)
    assert serve.log_config(args).level == "debug"
    assert serve.engine_config(parse("--block-size", "7")).cache.block_size == 7  # the CPU


def test_the_type_helpers_say_what_they_take():
    assert cli.int_in(0, 9)("9") == 9 and cli.positive_number("0.5") == 0.5
    for parse_value, text, message in [
        (cli.tcp_port, "65536", "must be 0-65535, got 65536"),
        (cli.int_at_least(2), "1", "must be at least 2, got 1"),
        (cli.int_in(high=3), "4", "must be at most 3, got 4"),
        (cli.number_at_least(1e-3), "0", "must be at least 0.001, got 0"),
        (cli.positive_number, "-inf", "must be a finite number more than 0, got -inf"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_value(text)
    # a ValueError, which argparse words as "invalid int value: 'x'"
    assert (cli.positive_int.__name__, cli.positive_number.__name__) == ("int", "float")
    with pytest.raises(ValueError):
        cli.positive_int("x")


def test_a_block_size_on_cuda_is_a_power_of_two():
    assert serve.engine_config(parse("--device", "cuda", "--block-size", "32")).cache.block_size
    with pytest.raises(ValueError, match="--block-size 48: on CUDA a power of two"):
        serve.engine_config(parse("--device", "cuda", "--block-size", "48"))


def test_port_65535_leaves_no_room_for_the_control_plane():
    with pytest.raises(ValueError, match="give --internal-port"):
        serve.server_config(parse("--port", "65535"))
    assert serve.server_config(parse("--port", "65535", "--internal-port", "9")).control_port == 9


def test_a_bad_log_level_in_the_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("FERRY_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit, match=r"^ferry: \$FERRY_LOG_LEVEL: unknown log level 'loud'$"):
        serve.log_config(parse())
    assert serve.log_config(parse("--log-level", "info")).level == "info"  # the flag wins


def test_the_log_level_flag_takes_warn_as_the_environment_does(monkeypatch):
    monkeypatch.setenv("FERRY_LOG_LEVEL", "warn")
    assert serve.log_config(parse()).level == "warn"
    assert parse("--log-level", "WARN").log_level == "warning"
    assert serve.log_config(parse("--log-level", "warn")).level == "warning"


def test_a_context_cut_short_is_said():
    assert serve.context_cut(999999, 8192) == ("--max-model-len 999999 is more than the model "
                                               "or its KV cache holds; serving a context of 8192")
    assert serve.context_cut(None, 2048) is None  # not asked: the default
    assert serve.context_cut(4096, 4096) is None and serve.context_cut(4096, 0) is None


@pytest.mark.parametrize("host, problem", [
    ("999.1.1.1", "--host 999.1.1.1 is neither an address nor a name this machine resolves"),
    ("192.0.2.1", "--host 192.0.2.1 is not an address of this machine"),  # TEST-NET-1
])  # fmt: skip
def test_a_host_that_cannot_be_listened_on_says_which_to_use(host, problem):
    with pytest.raises(SystemExit) as exit:
        serve._listen(host, 0, "--host", "--port")
    message = str(exit.value)
    assert message.startswith(f"ferry: cannot listen on {host}:0: {problem}")
    assert "--host 127.0.0.1" in message and "0.0.0.0" in message and "--port" not in message


def test_a_taken_control_port_names_its_flag():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match="is another ferry serve running.*--internal-port"):
            serve._bind(serve.server_config(parse("--port", "0", "--internal-port", str(port))))


def test_no_gpu_is_one_line_before_anything_starts(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    pd = serve.pd_config(parse("--device", "cuda", "--kv-transport", "cuda_ipc"))
    with pytest.raises(SystemExit, match="--device cuda, but no GPU is visible"):
        serve.check_device("cuda", pd)
    serve.check_device("cuda", serve.pd_config(parse("--prefill", "0", "--decode", "0")))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="--device cuda:2, but 2 GPU.s. are visible"):
        serve.check_device("cuda:2", None)
    serve.check_device("cuda:1", None)


def test_help_shows_a_default_of_zero():
    text = " ".join(commands(build_parser())["serve"].format_help().split())
    assert "(0: never) (default: 0)" in text  # --eplb-interval


def test_the_names_checked_when_parsed_are_the_engines():
    """serve names --dtype's and --speculative's values so as not to import torch; they
    must stay what the engine takes."""
    from engine.core import _DTYPES
    from engine.spec import DRAFTERS

    assert set(serve.DTYPES) == set(_DTYPES)
    own = {method for method, make in DRAFTERS.items() if make.__module__ == "engine.spec"}
    assert {*serve.DRAFTERS, "draft"} == own  # not those a benchmark registers (register_drafter)
