"""``ferry serve`` topology flags → ``PDConfig`` (or None for ``--aggregated``)."""

import pytest

from engine.worker.config import TransferConfig
from router.config import PDConfig
from server import serve
from server.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_default_topology_is_one_prefill_and_one_decode_worker_over_shm():
    assert serve.pd_config(parse()) == PDConfig()
    assert PDConfig().num_prefill == 1 and PDConfig().num_decode == 1
    assert PDConfig().transfer.transport == "shm"


def test_topology_flags():
    flags = ["--prefill", "2", "--decode", "3", "--kv-transport", "tcp",
             "--local-prefill-tokens", "0", "--kv-transfer-timeout", "5"]  # fmt: skip
    pd = serve.pd_config(parse(*flags))
    transfer = TransferConfig(transport="tcp", local_prefill_tokens=0, timeout_s=5.0)
    assert pd == PDConfig(num_prefill=2, num_decode=3, transfer=transfer)
    assert serve.pd_config(parse("--aggregated")) is None


def test_bad_topology_is_refused(capsys):
    with pytest.raises(SystemExit):  # when parsed; PDConfig refuses it too
        parse("--decode", "-1")
    assert "argument --decode: must be at least 0, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError):
        PDConfig(num_decode=-1)
    with pytest.raises(SystemExit):
        parse("--kv-transport", "pigeon")


def test_nccl_transport_needs_gpu_workers():
    from router.disagg import DisaggClient

    args = parse("--kv-transport", "nccl")
    with pytest.raises(ValueError, match="GPU"):
        DisaggClient(serve.engine_config(args), serve.pd_config(args))
