"""Bad input at the HTTP edge of a real ``ferry serve``: each abuse gets a 4xx in OpenAI's
error shape, never a 500, and the keep-alive connection that carried it serves the next
request; bodies past ``--max-body-mb`` get 413 before they are read; a 20 MB body does
not stall other clients; the served OpenAPI schema describes the request bodies and no
``/internal/*`` route."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from server.body import DEFAULT_MAX_BODY_MB

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD = {
    "json nested 2,000 deep": (
        CHAT, f'{{"messages": [{{"role": "user", "content": {nested(2000)}}}]}}'.encode()),
    "a lone surrogate escape": (
        CHAT, b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}'),
    "a lone low surrogate escape": (
        COMPLETIONS, b'{"prompt": "\\udc00", "max_tokens": 1}'),
    "a surrogate as raw bytes (not UTF-8)": (
        CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
    "a logit_bias key of 4,300 digits": (
        CHAT, json.dumps({"messages": HELLO, "logit_bias": {"7" * 4300: 1}}).encode()),
    "a max_tokens of 5,000 digits": (
        CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": '
        + b"9" * 5000 + b"}"),
    "a stop token id past 64 bits": (
        COMPLETIONS, json.dumps({"prompt": "Hi", "stop_token_ids": [2**70]}).encode()),
    "16 prompts x n=64": (
        COMPLETIONS, json.dumps({"prompt": ["Hi"] * 16, "n": 64, "max_tokens": 1}).encode()),
    "100,000 prompts": (
        COMPLETIONS, json.dumps({"prompt": ["Hi"] * 100_000, "max_tokens": 1}).encode()),
    "300,000 token ids": (
        COMPLETIONS, json.dumps({"prompt": [42] * 300_000, "max_tokens": 1}).encode()),
    "a JSON array for a body": (CHAT, b"[1, 2, 3]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_400_and_the_connection_serves_the_next_request(http, case):
    path, raw = BAD[case]
    bad = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    error = assert_openai_error(bad, 400)
    assert error["type"] == "invalid_request_error"
    good = http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})
    assert good.status_code == 200, good.text
    assert client_port(good) == client_port(bad)  # the same keep-alive connection


def test_the_fan_out_bound_says_how_many_sequences(http):
    error = assert_openai_error(
        http.post(COMPLETIONS, json={"prompt": ["Hi"] * 16, "n": 64}), 400
    )
    assert "1024 sequences" in error["message"] and "128" in error["message"]
    ok = http.post(COMPLETIONS, json={"prompt": ["Hi"] * 2, "n": 64, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 128


def raw_exchange(server, head: bytes, body_chunks=(), timeout: float = 30.0) -> bytes:
    """Send ``head`` then ``body_chunks`` on a fresh socket; everything it answers until
    it closes the connection."""
    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            sock.sendall(chunk)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def request_head(server, path: str, *headers: str) -> bytes:
    url = urlsplit(server.base_url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
             f"Authorization: Bearer {server.api_key}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_declared_length_past_the_limit_is_413_before_any_byte_is_read(server):
    limit = int(DEFAULT_MAX_BODY_MB * 2**20)
    started = time.monotonic()
    answer = raw_exchange(server, request_head(server, CHAT, f"Content-Length: {limit + 1}"))
    assert time.monotonic() - started < 10  # answered without waiting for the body
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_chunked_body_past_the_limit_is_413_as_it_streams(server):
    limit = int(DEFAULT_MAX_BODY_MB * 2**20)
    piece = b" " * (1 << 20)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (limit // len(piece))
    chunks.append(b"1\r\n \r\n")  # one byte over; the terminating chunk never comes
    answer = raw_exchange(server, request_head(server, CHAT, "Transfer-Encoding: chunked"),
                          chunks)  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]


def test_a_20_mb_body_does_not_stall_a_concurrent_small_request(server, http):
    big = {
        "text prompt": (COMPLETIONS, {"prompt": "The ferry left at dawn. " * 850_000}),
        "token id prompt": (COMPLETIONS, {"prompt": list(range(1000, 2_500_000))}),
        "messages": (CHAT, {"messages": [{"role": "user", "content": "Hello there"}] * 480_000}),
        "chat text": (CHAT, {"messages": [{"role": "user", "content": "Ahoy! " * 3_400_000}]}),
    }
    bodies = {name: (path, json.dumps(body).encode()) for name, (path, body) in big.items()}
    assert all(19 << 20 < len(raw) < 24 << 20 for _, raw in bodies.values())
    answers: dict[str, tuple[int, float]] = {}
    enough = threading.Event()  # the small requests have 10 samples beside the big ones

    def send_big() -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=300) as c:
            for _ in range(5):  # again while a fast machine leaves too few samples
                for name, (path, raw) in bodies.items():
                    started = time.monotonic()
                    r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
                    answers[name] = (r.status_code, time.monotonic() - started)
                if enough.is_set():
                    return

    sender = threading.Thread(target=send_big)
    sender.start()
    latencies = []
    while sender.is_alive():
        started = time.monotonic()
        assert http.get("/v1/models").status_code == 200
        latencies.append(time.monotonic() - started)
        if len(latencies) >= 10:
            enough.set()
        time.sleep(0.01)
    sender.join()
    assert {name: status for name, (status, _) in answers.items()} == dict.fromkeys(big, 400)
    assert len(latencies) >= 10
    assert max(latencies) < 1.0, (max(latencies), answers)


def test_openapi_describes_the_request_bodies_and_leaves_internal_routes_out(server):
    schema = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    assert not [p for p in schema["paths"] if p.startswith("/internal")]
    components = schema["components"]["schemas"]
    for path, model in ((CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert "messages" in components[model]["properties"] or model == "CompletionRequest"
    assert components["CompletionRequest"]["required"] == ["prompt"]
    assert components["ChatCompletionRequest"]["required"] == ["messages"]
    assert "ChatMessage" in components  # nested models are there too


def requests_counted(server, status: int) -> float:
    """``ferry_requests_total`` for chat completions answered with ``status``."""
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    prefix = f'ferry_requests_total{{endpoint="{CHAT}",status="{status}"}} '
    return sum(float(line.removeprefix(prefix)) for line in metrics.splitlines()
               if line.startswith(prefix))  # fmt: skip


def test_a_client_gone_before_its_body_ends_is_no_server_error(server, http):
    errors_before = requests_counted(server, 500)
    gone_before = requests_counted(server, 499)
    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request_head(server, CHAT, "Content-Length: 1000") + b'{"messages": [')
        time.sleep(0.5)  # the server is reading the body when the client leaves
    deadline = time.monotonic() + 10
    while requests_counted(server, 499) == gone_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_counted(server, 499) == gone_before + 1
    assert requests_counted(server, 500) == errors_before
    assert "ClientDisconnect" not in server.log_path.read_text(errors="replace")
    good = http.post(CHAT, json={"messages": HELLO, "max_tokens": 1})
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(("path", "body", "field", "problem"), [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages.0.content.0.text", "expected a string, got an integer"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.image_url", "Field required"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input.0.content.0.text", "expected a string, got an integer"),
])  # fmt: skip
def test_a_content_part_with_a_bad_field_names_the_field(http, path, body, field, problem):
    error = assert_openai_error(http.post(path, json={**body, "max_tokens": 1}), 400)
    assert f"{field}: {problem}" in error["message"], error
    assert error["param"] == field and "not supported" not in error["message"]
