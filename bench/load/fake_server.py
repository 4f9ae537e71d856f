"""A tiny OpenAI-shaped streaming server on raw asyncio sockets, as a peer for the client.

It answers ``POST /v1/chat/completions`` (streaming) with ``max_tokens`` chunks of one
word each, ``ttft_ms`` before the first and ``itl_ms`` between the others, then a usage
chunk and ``[DONE]``; ``POST /v1/responses`` alike with the Responses API's events
(``response.output_text.delta`` per word, then ``response.completed`` with the usage);
``GET /v1/models`` and ``GET /health`` too. It costs almost nothing
per chunk, so a load generator run against it measures the generator's own overhead.

The last user message steers failures: ``FAIL500`` answers HTTP 500, ``DROP`` closes the
connection after two chunks, ``BADJSON`` sends a malformed chunk.

    python -m bench.load.fake_server --port 8123 [--ttft-ms 0] [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

_MODELS = b'{"object":"list","data":[{"id":"fake-model","object":"model","owned_by":"bench"}]}'


@dataclass(frozen=True)
class FakeTiming:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _event(obj: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


class _ChatShape:
    """The chunks of a streamed chat completion."""

    base = {"id": "c1", "object": "chat.completion.chunk", "model": "fake-model"}

    def start(self) -> bytes:
        return _event({**self.base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})

    def token(self, text: str) -> bytes:
        return _event({**self.base, "choices": [{"index": 0, "delta": {"content": text}}]})

    def end(self, prompt: int, n: int) -> bytes:
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        return _event({**self.base, "choices": [], "usage": usage}) + _chunk(b"data: [DONE]\n\n")


class _ResponsesShape:
    """The typed events of a streamed Responses API response (the ones a client times)."""

    def start(self) -> bytes:
        return _event({"type": "response.created", "response": {"id": "r1", "output": []}})

    def token(self, text: str) -> bytes:
        return _event({"type": "response.output_text.delta", "item_id": "m1", "output_index": 0,
                       "content_index": 0, "delta": text})  # fmt: skip

    def end(self, prompt: int, n: int) -> bytes:
        usage = {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n,
                 "input_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        return _event({"type": "response.completed", "response": {"id": "r1", "usage": usage}})


async def _stream(writer: asyncio.StreamWriter, req: dict, timing: FakeTiming) -> None:
    shape = _ChatShape() if "messages" in req else _ResponsesShape()
    n = int(req.get("max_tokens") or req.get("max_output_tokens") or 16)
    messages = req.get("messages") or req["input"]
    last = str(messages[-1].get("content", ""))
    if "FAIL500" in last:
        writer.write(_response("500 Internal Server Error", b'{"error":{"message":"boom"}}'))
        return
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    writer.write(shape.start())
    await asyncio.sleep(timing.ttft_ms / 1e3)
    for i in range(n):
        if i:
            await asyncio.sleep(timing.itl_ms / 1e3)
        if "DROP" in last and i == 2:
            writer.close()
            return
        writer.write(shape.token(f" w{i}"))
        if "BADJSON" in last and i == 1:
            writer.write(_chunk(b"data: {not json\n\n"))
        await writer.drain()
    prompt = sum(len(str(m.get("content", "")).split()) for m in messages)
    writer.write(shape.end(prompt, n) + _chunk(b""))


async def _handle(reader, writer, timing: FakeTiming) -> None:
    try:
        while True:
            method, path, body = await _read_request(reader)
            if method == "POST" and path.endswith(("/chat/completions", "/responses")):
                await _stream(writer, json.loads(body), timing)
            elif path.endswith("/models"):
                writer.write(_response("200 OK", _MODELS))
            else:
                writer.write(_response("200 OK" if path == "/health" else "404 Not Found", b""))
            await writer.drain()
            if writer.is_closing():
                return
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass  # client gone or server closing (3.11 logs a cancelled handler otherwise)
    finally:
        writer.close()


async def start(host: str, port: int, timing: FakeTiming) -> asyncio.Server:
    """Start serving on ``host:port`` (0: any free port) in the running event loop."""

    async def handle(reader, writer):  # asyncio sets TCP_NODELAY on its TCP transports
        await _handle(reader, writer, timing)

    return await asyncio.start_server(handle, host, port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    args = p.parse_args()

    async def serve() -> None:
        server = await start(args.host, args.port, FakeTiming(args.ttft_ms, args.itl_ms))
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
