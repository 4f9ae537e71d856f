"""What an operator reads: the start-up log says what runs where, every request has one
access-log line and an id that the workers' lines name too, ``--log-format json`` makes
every process write JSON, and every metric the dashboard and the autoscaler query is one
that ``ferry serve`` exports. Real servers (``dummy:tiny``, 1 prefill + 1 decode worker),
real HTTP, the real log files."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import API_KEY, Server, _process, run_server
from helpers import ferry_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# long enough that the decode worker asks a prefill worker for it (> --local-prefill-tokens)
PROMPT = "Operators read logs; the marker word zanzibarquux must never appear in them. " * 3


@pytest.fixture(scope="module")
def text_server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("operating")
    flags = ["--model", "dummy:tiny", "--threads", "1", "--host-kv-cache-gb", "0.25",
             "--kv-dir", str(tmp / "kv"), "--kv-file-capacity-gb", "3",
             "--kv-file-ttl-hours", "5"]  # fmt: skip
    with run_server(tmp / "serve.log", *flags) as server:
        yield server


def _lines(server: Server, pattern: str) -> list[str]:
    return [line for line in server.log_path.read_text().splitlines() if re.search(pattern, line)]


def test_the_startup_log_names_each_worker_its_device_kv_size_transport_and_tiers(text_server):
    log = text_server.log_path.read_text()
    kv_dir = re.escape(str(text_server.log_path.parent / "kv"))
    for role, name in (("prefill", "p0"), ("decode", "d0")):
        line = re.search(rf"^ferry: {role} worker {name} ready on cpu: KV cache ([\d.]+) "
                         rf"(KB|MB|GB) \((\d+) blocks of 16 tokens, context \d+\), KV transport "
                         rf"shm.*, tiers: host 0\.25 GB, file {kv_dir} \(cap 3 GB, TTL 5 h\); "
                         rf"started in [\d.]+ s: process [\d.]+(, [a-z -]+ [\d.]+)*$",
                         log, re.MULTILINE)  # fmt: skip
        assert line, log
        assert float(line.group(1)) > 0 and int(line.group(3)) > 1
        assert "receiver" not in line.group(0)  # a /proc/<pid>/fd path: debug level only
    assert "replay recorded kernel calls" not in log  # the ready line's "graphs" says it
    starting = log.index("ferry: starting 1 prefill + 1 decode worker(s) for dummy-tiny (random "
                         "weights) on cpu, KV over shm; a first start also builds the CPU "
                         "kernels into ")  # the model, where its weights come from, what once
    ready = re.search(r"^ferry: ready in [\d.]+ s \(/ready answers 200\)$", log, re.MULTILINE)
    assert ready and starting < log.index("ferry: prefill worker p0 ready") < ready.start()


def test_a_request_has_one_access_line_and_its_id_on_every_worker_that_served_it(text_server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    reply = httpx.post(f"{text_server.v1}/completions", json=body, timeout=60,
                       headers={**text_server.headers, "x-request-id": "trace-42.a"})  # fmt: skip
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42.a"
    usage = reply.json()["usage"]
    deadline = time.monotonic() + 10
    while not _lines(text_server, r"ferry\.access: \[trace-42\.a\]"):
        assert time.monotonic() < deadline, text_server.log_tail()
        time.sleep(0.1)
    (access,) = _lines(text_server, r"ferry\.access: \[trace-42\.a\]")
    fields = re.search(r"POST /v1/completions 200 prompt=(\d+) output=(\d+) cached=(\d+) "
                       r"ttft=([\d.]+)s duration=([\d.]+)s$", access)  # fmt: skip
    assert fields, access
    prompt, output, cached, ttft, duration = fields.groups()
    assert (int(prompt), int(output), int(cached)) == (
        usage["prompt_tokens"], usage["completion_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"])  # fmt: skip
    assert 0 < float(ttft) <= float(duration)
    # each worker process logs the request under the same id
    mine = r"ferry\.worker: \[trace-42\.a\] cmpl-\S+ ended"
    prefill = _lines(text_server, rf"INFO p0 {mine} \(PrefillDone\)")
    decode = _lines(text_server, rf"INFO d0 {mine} \(length\)")
    assert len(prefill) == 1 and len(decode) == 1, text_server.log_tail()
    assert f"{usage['prompt_tokens']} prompt tokens" in decode[0]


def test_a_request_without_an_id_gets_a_fresh_one_and_odd_ids_are_replaced(text_server):
    ids = set()
    for sent in (None, "has spaces", "x" * 65):
        headers = {**text_server.headers, **({"x-request-id": sent} if sent else {})}
        reply = httpx.get(f"{text_server.v1}/models", headers=headers, timeout=30)
        ids.add(reply.headers["x-request-id"])
    assert len(ids) == 3 and all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids)
    assert httpx.get(f"{text_server.base_url}/health", timeout=30).headers["x-request-id"]


def test_no_prompt_or_generated_text_reaches_the_logs(text_server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{text_server.v1}/chat/completions", json=body,
                      headers=text_server.headers, timeout=60) as reply:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    time.sleep(0.5)
    log = text_server.log_path.read_text()
    assert "zanzibarquux" not in log
    assert "POST /v1/chat/completions 200" in log
    words = [w for w in re.findall(r"\w{6,}", text) if w not in log]  # generated text
    assert len(words) == len(re.findall(r"\w{6,}", text))


def test_every_process_froze_its_startup_and_reports_its_collectors_pauses(text_server):
    """The frontend and both workers moved their startup's objects (imports, model,
    tokenizer) out of the garbage collector's walk, and ``/metrics`` shows each one's
    collections and pauses by generation."""
    from prometheus_client.parser import text_string_to_metric_families

    body = {"prompt": "Collect me", "max_tokens": 4}
    assert httpx.post(f"{text_server.v1}/completions", json=body, headers=text_server.headers,
                      timeout=60).status_code == 200  # fmt: skip
    processes = {("frontend", "frontend"), ("prefill", "p0"), ("decode", "d0")}
    deadline = time.monotonic() + 10
    while True:  # the workers' figures ride on their stats, at least once a second
        text = httpx.get(f"{text_server.base_url}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        frozen = {(s.labels["role"], s.labels["worker"]): s.value
                  for s in families["ferry_gc_frozen_objects"].samples}  # fmt: skip
        if set(frozen) == processes or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(frozen) == processes, frozen
    assert all(n > 10_000 for n in frozen.values()), frozen  # torch's modules alone are more
    for name in ("ferry_gc_collections", "ferry_gc_pause_seconds"):
        rows = [s for s in families[name].samples if s.name.endswith("_total")]
        assert {(s.labels["role"], s.labels["worker"], s.labels["generation"]) for s in rows} == {
            (*p, g) for p in processes for g in "012"}  # fmt: skip
        assert all(s.value >= 0 for s in rows)
    longest = families["ferry_gc_longest_pause_seconds"].samples
    assert {(s.labels["role"], s.labels["worker"]) for s in longest} == processes


def _scraped_names(server: Server) -> set[str]:
    """Every sample name ``/metrics`` can show, from its families' names and types (a
    labelled family that has no sample yet still counts)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                "_created"), "summary": ("_sum", "_count", "_created"), "gauge": ("",)}  # fmt: skip
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_every_metric_the_dashboard_and_the_autoscaler_query_is_one_ferry_exports(text_server):
    exported = _scraped_names(text_server)
    assert "ferry_worker_healthy" in exported and "ferry_requests_rejected_total" in exported
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "ferry.json").read_text())
    queries = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    assert len(queries) >= 30
    for expr in queries:
        named = set(re.findall(r"\bferry_[a-z0-9_]+", expr))
        assert named, f"a query that names no ferry metric: {expr}"
        assert named <= exported, f"{sorted(named - exported)} not exported ({expr})"
    wanted = {"ferry_time_to_first_token_seconds_bucket",
              "ferry_inter_token_latency_seconds_bucket",
              "ferry_e2e_request_latency_seconds_bucket", "ferry_kv_tier_hit_tokens_total",
              "ferry_kv_transfer_bytes_total", "ferry_queued_requests",
              "ferry_requests_rejected_total", "ferry_worker_healthy",
              "ferry_worker_restarts_total", "ferry_kv_blocks_used"}  # fmt: skip
    assert wanted <= {n for q in queries for n in re.findall(r"\bferry_[a-z0-9_]+", q)}
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "frontend.yaml").read_text()):
        if doc["kind"] == "HorizontalPodAutoscaler":
            pods = [m["pods"]["metric"]["name"] for m in doc["spec"]["metrics"] if "pods" in m]
            assert pods and set(pods) <= exported


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out += [p, *_panels(p.get("panels", []))]
    return out


def test_with_a_topology_file_and_json_logs_every_process_writes_json(tmp_path):
    topology = tmp_path / "topo.yaml"
    topology.write_text(yaml.safe_dump({
        "model": {"model": "dummy:tiny", "threads": 1},
        "server": {"port": 0},
        "pools": {"prefill": 1, "decode": 1},
        "tiers": {"kv-tiers": "none"},
        "log": {"log-format": "json"},
    }))  # fmt: skip
    log_path = tmp_path / "serve.log"
    command = [*ferry_command(), "serve", "--config", str(topology), "--api-key", API_KEY]
    with _process(command, log_path) as proc:
        url = _wait_for_json(proc, log_path, "serving ")["url"]
        reply = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {API_KEY}",
                                    "x-request-id": "json-7"})  # fmt: skip
        assert reply.status_code == 200
        access = _wait_for_json(proc, log_path, "POST /v1/completions")
    records = [json.loads(line) for line in log_path.read_text().splitlines()]  # all of them
    assert access["request_id"] == "json-7" and access["status"] == 200
    assert access["output_tokens"] == 4 and access["ttft_s"] > 0
    workers = {r["process"] for r in records if r.get("request_id") == "json-7"}
    assert workers == {"frontend", "p0", "d0"}
    ready = [r for r in records if r["msg"].startswith(("prefill worker p0 ready",
                                                        "decode worker d0 ready"))]  # fmt: skip
    assert len(ready) == 2 and all(r["tiers"] == "none" and r["device"] == "cpu" for r in ready)


def _wait_for_json(proc, log_path: Path, prefix: str) -> dict:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the line being written
                continue
            if record["msg"].startswith(prefix):
                return record
        assert proc.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.25)
    raise AssertionError(f"no {prefix!r} line:\n{log_path.read_text()[-3000:]}")
