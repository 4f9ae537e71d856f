"""Image chat end to end: ``ferry serve`` with a tiny random Qwen2.5-VL folder, its images
encoded on an encode worker of their own (1 encode + 1 prefill + 1 decode worker), against
the same model ``--aggregated``; the official ``openai`` client.

``--local-prefill-tokens 0``: every prompt goes to the prefill worker (otherwise a decode
worker that holds a repeated prompt computes its short tail itself, and the image never
needs encoding again). The limits are small so that each is easy to cross.
"""

from __future__ import annotations

import base64
import http.server
import io
import random
import threading

import pytest
from conftest import assert_sound, run_server
from helpers import metric
from hf_models import random_image, write_tiny_vlm

MAX_IMAGE_BYTES = 64 * 1024
MAX_PIXELS = 200 * 200
LIMITS = ("--max-image-mb", str(MAX_IMAGE_BYTES / 2**20), "--max-image-pixels", str(MAX_PIXELS),
          "--max-images-per-request", "3")  # fmt: skip
COMMON = ("--threads", "1", "--max-model-len", "1024", *LIMITS)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(images: list[str], text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [*map(image_part, images), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves ``/cat.png`` (a PNG), ``/big.png`` (past the byte limit), ``/moved``."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.files = {"/cat.png": random_image(3, 120, 90),
                     "/big.png": random_image(4, 199, 199)}  # fmt: skip
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def epd(model_dir, tmp_path_factory):
    """1 encode + 1 prefill + 1 decode worker; image URLs of 127.0.0.1 are fetched."""
    log = tmp_path_factory.mktemp("epd") / "serve.log"
    flags = ("--model", str(model_dir), "--encode", "1", "--local-prefill-tokens", "0",
             "--allowed-media-domains", "127.0.0.1", *COMMON)  # fmt: skip
    with run_server(log, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def aggregated(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("agg") / "serve.log"
    with run_server(log, "--model", str(model_dir), "--aggregated", *COMMON) as s:
        yield s


def _answer(server, messages: list[dict], stream: bool = False, **extra) -> tuple[str, object]:
    client = server.openai()
    args = dict(model=server.model, messages=messages, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}, **extra)  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1]


def _tokens(response) -> list[tuple[str, float]]:
    return [(t.token, round(t.logprob, 3)) for t in response.choices[0].logprobs.content]


def test_an_image_chat_answers_streamed_and_not_through_the_openai_client(epd):
    messages = chat([data_url(random_image(1, 130, 100))])
    text, whole = _answer(epd, messages)
    streamed, last = _answer(epd, messages, stream=True)
    assert whole.usage.completion_tokens == 12 and last.usage.completion_tokens == 12
    assert streamed == text
    # the image took its placeholder tokens: far more prompt than the text alone
    assert whole.usage.prompt_tokens > 60
    health = epd.health()
    assert sorted(w["role"] for w in health["workers"]) == ["decode", "encode", "prefill"]


def test_the_same_image_twice_hits_the_embedding_cache_and_the_prefix_cache(epd):
    messages = chat([data_url(random_image(11, 140, 110))], "Once more.")
    hits = metric(epd, "ferry_encode_cache_hits_total", tier="memory")
    _, first = _answer(epd, messages)
    _, again = _answer(epd, messages)
    assert metric(epd, "ferry_encode_cache_hits_total", tier="memory") == hits + 1
    assert first.usage.prompt_tokens_details.cached_tokens < 40  # the template's prefix only
    assert again.usage.prompt_tokens_details.cached_tokens == (
        (again.usage.prompt_tokens - 1) // 16 * 16
    )  # fmt: skip


def test_two_different_images_with_the_same_text_share_no_kv_for_the_image_tokens(epd):
    a, b = random_image(21, 130, 100), random_image(22, 130, 100)  # same size, same tokens
    _, first = _answer(epd, chat([data_url(a)], "Same words."))
    _, second = _answer(epd, chat([data_url(b)], "Same words."))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    # what they share is the system prompt and the user turn's opening: the blocks before
    # the first image token, which is token 45 ("<|im_start|>system\n...<|vision_start|>")
    assert second.usage.prompt_tokens_details.cached_tokens <= 45 // 16 * 16


def test_answers_are_token_identical_to_the_aggregated_engine(epd, aggregated):
    cases = [
        chat([data_url(random_image(31, 130, 100))]),
        chat([data_url(random_image(32, 90, 150)), data_url(random_image(33, 160, 120))],
             "Compare the two."),
        [{"role": "user", "content": [image_part(data_url(random_image(34, 100, 100)))]},
         {"role": "assistant", "content": "A square."},
         {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                      image_part(data_url(random_image(35, 120, 60)))]}],
    ]  # fmt: skip
    for messages in cases:
        _, ours = _answer(epd, messages, logprobs=True)
        _, theirs = _answer(aggregated, messages, logprobs=True)
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
        assert _tokens(ours) == _tokens(theirs)


def test_an_image_url_of_an_allowed_host_is_fetched(epd, image_host):
    fetched, _ = _answer(epd, chat([f"{image_host}/cat.png"]))
    inline, _ = _answer(epd, chat([data_url(_Images.files["/cat.png"])]))
    assert fetched == inline


def _status(server, messages: list[dict]) -> tuple[int, dict]:
    with server.http() as h:
        r = h.post("/chat/completions", json={"model": server.model, "messages": messages,
                                              "max_tokens": 2})  # fmt: skip
    return r.status_code, r.json()


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", (60, 40), random.Random(seed).randbytes(60 * 40 * 3)).save(out, "JPEG")
    return out.getvalue()


def _tiff() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(out, "TIFF")
    return out.getvalue()


def _huge_header() -> bytes:
    """A PNG whose header says 5000 x 5000 (25 M pixels), with a few bytes of data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 5000, 5000, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b""))  # fmt: skip


LIMIT_CASES = {
    "bytes": ([data_url(random_image(5, 190, 190))], f"larger than {MAX_IMAGE_BYTES} bytes"),
    "pixels": ([data_url(_huge_header())], f"at most {MAX_PIXELS} are accepted"),
    "count": ([data_url(random_image(i, 30, 30)) for i in range(4)], "at most 3 are accepted"),
    "undecodable": ([data_url(b"\x89PNG\r\n\x1a\n this is not an image")], "Pillow can read"),
    "truncated": ([data_url(_jpeg(6)[: len(_jpeg(6)) * 2 // 3], "image/jpeg")],
                  "truncated or damaged"),
    "truncated header": ([data_url(_jpeg(6)[:400], "image/jpeg")], "truncated or damaged"),
    "format": ([data_url(_tiff(), "image/tiff")], "format TIFF is not supported"),
    "not an image type": ([data_url(b"hello", "text/plain")], "Unsupported media type"),
    "bad base64": (["data:image/png;base64,@@@notbase64@@@"], "invalid base64"),
    "file url": (["file:///etc/passwd"], "file:// image URLs are not read"),
    "host not allowed": (["https://example.com/cat.png"], "are not fetched"),
}


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_every_image_limit_returns_its_400(epd, case):
    urls, message = LIMIT_CASES[case]
    status, body = _status(epd, chat(urls))
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]
    assert body["error"]["param"].startswith("messages")


def test_fetching_is_bounded_and_follows_no_redirect(epd, image_host):
    status, body = _status(epd, chat([f"{image_host}/big.png"]))
    assert status == 400 and "larger than" in body["error"]["message"]
    status, body = _status(epd, chat([f"{image_host}/moved"]))
    assert status == 400 and "HTTP 302" in body["error"]["message"]


def test_an_image_for_a_text_model_is_refused_naming_the_model(server):
    status, body = _status(server, chat([data_url(random_image(7, 40, 40))]))
    assert status == 400
    assert f"`{server.model}` does not accept images" in body["error"]["message"]


def _bad_image(rng: random.Random) -> str:
    """One of the ways an image can be broken, at random."""
    good = random_image(rng.randrange(1000), rng.randrange(20, 120), rng.randrange(20, 120))
    kind = rng.randrange(6)
    if kind == 0:
        return data_url(rng.randbytes(rng.randrange(1, 3000)))
    if kind == 1:
        return data_url(good[: rng.randrange(8, len(good) - 1)])  # cut short
    if kind == 2:  # flipped bytes after the signature
        data = bytearray(good)
        for _ in range(20):
            data[rng.randrange(16, len(data))] ^= 0xFF
        return data_url(bytes(data))
    if kind == 3:
        return data_url(_jpeg(rng.randrange(1000))[: rng.randrange(100, 600)], "image/jpeg")
    if kind == 4:
        return data_url(_huge_header())
    return "data:image/png;base64," + base64.b64encode(good).decode()[: rng.randrange(4, 200)] + "!"


def test_fifty_requests_with_random_bad_images_leave_every_worker_healthy(epd):
    rng = random.Random(1234)
    statuses = [_status(epd, chat([_bad_image(rng)]))[0] for _ in range(50)]
    assert statuses.count(400) >= 45  # a flipped byte may miss what PNG checks: still served
    assert all(s in (200, 400) for s in statuses)
    text, _ = _answer(epd, chat([data_url(random_image(1, 130, 100))]))
    assert text is not None
    assert all(w["healthy"] for w in epd.health()["workers"])
    assert_sound(epd)
