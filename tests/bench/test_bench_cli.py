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
    args = parser.parse_args(["bench", "--url", "u", "--rate", "2.5", "--out", "x.json"])
    assert (args.mode, args.rate) == ("run", [2.5])


def test_concurrency_and_rate_exclude_each_other():
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--url", "u", "--rate", "1", "--concurrency", "2", "--out", "o"])


def test_a_single_run_refuses_a_list_of_loads(tmp_path):
    assert cli.main(["--url", "u", "--concurrency", "1,2", "--out", str(tmp_path / "o")]) == 2


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
