#!/usr/bin/env bash
# The NCCL transport on a two-GPU machine: its round-trip test, then its throughput
# against torch.distributed's own send/recv (bench/kv_transfer.py), JSON into $1.
# Run from the project root with the GPU bundle unpacked on PYTHONPATH
# (see ../shared/gpu/README.md); keep NCCL_NVLS_ENABLE=0.
set -u
out=${1:-bench/results}
export NCCL_NVLS_ENABLE=0
nvidia-smi -L
if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_transport_nccl_gpu.py 2>&1 | tail -5
else  # no pytest there: run the test function with a minimal stand-in
    stub=$(mktemp -d)
    cat >"$stub/pytest.py" <<'PY'
import contextlib, re
class _Mark:
    def __getattr__(self, name):
        return lambda *a, **k: (lambda f: f)
mark = _Mark()
@contextlib.contextmanager
def raises(exc, match=None):
    try:
        yield
    except exc as e:
        assert match is None or re.search(match, str(e)), str(e)
        return
    raise AssertionError(f"did not raise {exc.__name__}")
PY
    PYTHONPATH="$stub:$PYTHONPATH" python3 -c "
import sys; sys.path.insert(0, 'tests/kvstore')
import test_transport_nccl_gpu as t
t.test_nccl_round_trip_between_two_gpus()
print('test_nccl_round_trip_between_two_gpus passed')"
fi
python3 bench/kv_transfer.py --device cuda:0 --backends nccl --repeats 10 \
    --sizes-mb 1 2 4 8 16 32 64 --out "$out/kv_transfer_h200.json"
