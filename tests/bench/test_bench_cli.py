"""The command line and the sweep's JSON and plots, against the fake server."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from bench.load import cli
from bench.load.plots import pareto_front, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_registers_as_a_ferry_subcommand():
    parser = argparse.ArgumentParser(prog="ferry")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["bench", "sweep", "--url", "http://h:1", "--concurrency", "1,4,16",
                              "--out", "x.json"])  # fmt: skip
    assert (args.mode, args.concurrency, args.rate) == ("sweep", [1.0, 4.0, 16.0], None)
    args = parser.parse_args(["bench", "--url", "http://u", "--rate", "2.5", "--out", "x.json"])
    assert (args.mode, args.rate) == ("run", [2.5])


def test_concurrency_and_rate_exclude_each_other():
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--url", "http://u", "--rate", "1", "--concurrency", "2"])


def test_a_single_run_refuses_a_list_of_loads():
    assert cli.main(["--url", "http://u", "--concurrency", "1,2"]) == 2


def test_pareto_front_keeps_undominated_points():
    pts = [(10.0, 100.0), (5.0, 300.0), (4.0, 250.0), (2.0, 400.0), (1.0, 390.0)]
    assert pareto_front(pts) == [(2.0, 400.0), (5.0, 300.0), (10.0, 100.0)]


def test_plots_are_written_as_png(tmp_path):
    dist = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    points = [
        {"load": c, "summary": {"per_user_output_tok_s": 100 / c, "output_throughput": 50 * c,
                                "ttft_ms": dist, "itl_ms": dist}}
        for c in (1, 2, 4)
    ]  # fmt: skip
    paths = write_plots(points, "concurrency", tmp_path / "s", "test")
    assert [p.name for p in paths] == ["s.png", "s_pareto.png", "s_ttft.png", "s_itl.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def _serve_fake_in_thread():
    """The fake server in its own thread and loop (the CLI runs its own event loop)."""
    import asyncio

    from bench.load.fake_server import FakeTiming, start

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(start("127.0.0.1", 0, FakeTiming(itl_ms=1)))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return server.sockets[0].getsockname()[1]


def test_run_and_sweep_write_json_and_plots(tmp_path):
    url = f"http://127.0.0.1:{_serve_fake_in_thread()}"
    common = ["--url", url, "--num-requests", "6", "--output-len", "4", "--input-len", "8",
              "--no-progress", "--slo-ttft-ms", "1000"]  # fmt: skip
    out = tmp_path / "run.json"
    assert cli.main([*common, "--concurrency", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["model"] == "fake-model" and len(record["requests"]) == 6
    assert record["summary"]["completed"] == 6 and record["summary"]["goodput"] > 0
    out = tmp_path / "sweep.json"
    assert cli.main(["sweep", *common, "--concurrency", "1,3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [p["concurrency"] for p in record["points"]] == [1, 3]
    assert all((tmp_path / name).read_bytes()[:8] == PNG_MAGIC for name in record["plots"])


def _bench_parser() -> argparse.ArgumentParser:
    from server.cli import build_parser, commands

    return commands(build_parser())["bench"]


def test_help_shows_every_default_as_it_is_typed():
    text = " ".join(_bench_parser().format_help().split())
    assert "(default: 448x448)" in text and "(448, 448)" not in text
    assert "unrecorded requests before each point (default: 0)" in text
    assert "--seed SEED which prompts" in text  # it has help
    assert _bench_parser().parse_args(["--url", "http://h", "--rate", "1"]).image_size == (448, 448)


def test_its_line_in_ferry_help_reads_like_the_others():
    from server.cli import build_parser

    line = next(x for x in build_parser().format_help().splitlines() if "bench" in x)
    assert line.split()[1] == "load-test"


@pytest.mark.parametrize("argv, error", [
    (["--url", "localhost:8000"], "argument --url: an http:// or https:// URL"),
    (["--concurrency", "1.5"], "argument --concurrency: concurrencies must be whole numbers"),
    (["--num-requests", "0"], "argument --num-requests: must be at least 1, got 0"),
    (["--input-len", "-1"], "argument --input-len: must be at least 1, got -1"),
    (["--range-ratio", "1"], "argument --range-ratio: must be at least 0 and below 1, got 1"),
    (["--turns", "0"], "argument --turns: must be at least 1, got 0"),
    (["--think-time", "-1"], "argument --think-time: must be at least 0, got -1"),
    (["--workload", "missing.jsonl"], "argument --workload: one of random, shared-prefix"),
    (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be more than 0, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    (["--timeout", "0"], "argument --timeout: must be more than 0, got 0"),
    (["--streams-per-client", "0"], "argument --streams-per-client: must be at least 1, got 0"),
])  # fmt: skip
def test_a_bad_value_is_refused_when_parsed(argv, error, capsys):
    base = ["--url", "http://h", "--concurrency", "1"]
    with pytest.raises(SystemExit):
        _bench_parser().parse_args([*base, *argv])
    assert error in capsys.readouterr().err.splitlines()[-1]


def test_without_out_the_results_go_to_a_file_named_for_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"http://127.0.0.1:{_serve_fake_in_thread()}"
    assert cli.main(["--url", url, "--num-requests", "2", "--output-len", "2", "--input-len",
                     "4", "--no-progress", "--concurrency", "1"]) == 0  # fmt: skip
    (written,) = tmp_path.glob("ferry-bench-run-*.json")
    record = json.loads(written.read_text())
    assert record["summary"]["completed"] == 2 and record["config"]["out"] == written.name
