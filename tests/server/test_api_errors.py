"""Each bad request gets its status and an OpenAI-shaped error body from a real server."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def test_invalid_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b'{"messages": [',
                         headers={"Content-Type": "application/json"})  # fmt: skip
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Invalid JSON body: ")
    assert error["message"].count("Invalid JSON") == 1  # pydantic's own prefix left out


def test_a_value_of_another_json_type_is_400_as_openai_answers(http):
    for field, value in (("stream", "yes"), ("max_tokens", "5"), ("logprobs", 1)):
        body = {"messages": QUESTION, field: value}
        error = _error(http.post("/v1/chat/completions", json=body), 400)
        assert error["param"] == field and "expected" in error["message"]
    body = {"messages": QUESTION, "max_tokens": 2, "temperature": 1, "stream": False}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_schema_violation_is_400_not_422(http):
    error = _error(http.post("/v1/chat/completions", json={"messages": "hello"}), 400)
    assert error["param"] == "messages"


def test_unknown_model_is_404_model_not_found_naming_the_served_one(http, server):
    response = http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": QUESTION})
    error = _error(response, 404)
    assert error["code"] == "model_not_found"
    assert "gpt-17" in error["message"] and f"serves `{server.model}`" in error["message"]
    assert f"serves `{server.model}`" in _error(http.get("/v1/models/gpt-17"), 404)["message"]


def test_context_overflow_is_400_with_the_numbers(http):
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert context < 9000
    response = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 9000})
    error = _error(response, 400)
    message = error["message"]
    assert f"maximum context length is {context} tokens" in message
    assert "9000 in the completion" in message
    prompt_tokens = int(message.split("tokens (")[1].split(" in the prompt")[0])
    assert f"you requested {prompt_tokens + 9000} tokens" in message


def test_chat_context_overflow_counts_the_messages(http):
    response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8192})
    message = _error(response, 400)["message"]
    assert "in the messages, 8192 in the completion" in message


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", 5, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_logprobs", 50, "top_logprobs"),
        ("n", 0, "n"),
        ("n", 1000, "n"),
        ("presence_penalty", 3, "presence_penalty"),
        ("logit_bias", {"not-a-token": 1}, "logit_bias"),
        ("logit_bias", {"99999999": 1}, "99999999"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("max_tokens", 0, "max_tokens"),
    ],
)
def test_out_of_range_sampling_values_are_400(http, field, value, needle):
    body = {"messages": QUESTION, "max_tokens": 4, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert needle in error["message"] or error["param"] == field


# logprobs on, which top_logprobs needs
BODIES = {"/v1/chat/completions": {"messages": QUESTION, "logprobs": True},
          "/v1/completions": {"prompt": "Hi"}}  # fmt: skip


@pytest.mark.parametrize(("path", "field", "value", "message"), [
    ("/v1/chat/completions", "temperature", 5, "temperature must be in [0, 2], got 5.0"),
    ("/v1/chat/completions", "top_p", 0, "top_p must be in (0, 1], got 0.0"),
    ("/v1/chat/completions", "min_p", 2, "min_p must be in [0, 1], got 2.0"),
    ("/v1/chat/completions", "frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("/v1/chat/completions", "repetition_penalty", 0, "repetition_penalty must be in (0, 2]"),
    ("/v1/chat/completions", "top_logprobs", 50, "top_logprobs must be in [0, 20], got 50"),
    ("/v1/chat/completions", "logit_bias", {"5": 101}, "logit_bias for token 5 must be in"),
    ("/v1/completions", "logprobs", 50, "logprobs must be in [0, 20], got 50"),
    ("/v1/completions", "prompt_logprobs", 21, "prompt_logprobs must be in [0, 20], got 21"),
    ("/v1/chat/completions", "logit_bias", {"99999999": 1}, "token id 99999999 is outside"),
    ("/v1/completions", "stop_token_ids", [99999999], "token id 99999999 is outside"),
])  # fmt: skip
def test_a_sampling_value_out_of_range_is_400_naming_its_field(http, path, field, value,
                                                                message):  # fmt: skip
    body = {**BODIES[path], "max_tokens": 2, field: value}
    error = _error(http.post(path, json=body), 400)
    assert error["param"] == field and error["message"].startswith(message), error


@pytest.mark.parametrize("value", [0, -5])
def test_max_completion_tokens_below_one_is_400_naming_it(http, value):
    body = {"messages": QUESTION, "max_completion_tokens": value}
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "max_completion_tokens"
    assert f"max_completion_tokens must be at least 1, got {value}" == error["message"]


def test_empty_messages_is_400(http):
    error = _error(http.post("/v1/chat/completions", json={"messages": []}), 400)
    assert error["param"] == "messages"


def test_empty_and_out_of_vocabulary_prompts_are_400(http):
    error = _error(http.post("/v1/completions", json={"prompt": []}), 400)
    assert (error["param"], error["message"]) == ("prompt", "prompt: must not be empty")
    _error(http.post("/v1/completions", json={"prompt": [[]]}), 400)
    error = _error(http.post("/v1/completions", json={"prompt": [1, 10_000_000]}), 400)
    assert "10000000" in error["message"]


def test_suffix_is_400(http):
    error = _error(http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400)
    assert error["param"] == "suffix"


def test_image_parts_for_a_text_model_are_400(http):
    content = [{"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]
    body = {"messages": [{"role": "user", "content": content}]}
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert "does not accept images" in error["message"], error


def test_unknown_fields_are_ignored(http):
    body = {"messages": QUESTION, "max_tokens": 2, "frobnicate": True, "temperature": 0}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        response = httpx.post(f"{server.v1}/chat/completions", headers=headers,
                              json={"messages": QUESTION})  # fmt: skip
        error = _error(response, 401)
        assert error["type"] == "authentication_error"
    _error(httpx.get(f"{server.v1}/models"), 401)


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics")
    assert metrics.status_code == 200
    assert "ferry_kv_blocks_total" in metrics.text


def test_health_without_the_key_says_only_the_status(server):
    anonymous = httpx.get(f"{server.base_url}/health")
    assert anonymous.status_code == 200
    body = anonymous.json()
    assert body["status"] == "ok" and "workers" not in body and "API key" in body["detail"]
    assert "pid" not in anonymous.text and "ipc://" not in anonymous.text
    wrong = httpx.get(f"{server.base_url}/health", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 200 and "workers" not in wrong.json()
    full = server.health()  # with the key: every worker, its pid and address
    assert full["status"] == "ok" and {"prefill", "decode"} <= {w["role"] for w in full["workers"]}
    assert all(w["pid"] and w["address"].startswith("ipc://") for w in full["workers"])


def test_unknown_route_is_404_in_openai_shape_naming_the_routes(http):
    _error(http.get("/v1/nothing-here"), 404)
    error = _error(http.post("/v1/embeddings", json={"input": "hi"}), 404)
    assert error["type"] == "invalid_request_error"
    message = error["message"]
    assert message.startswith("POST /v1/embeddings is not a route of this server")
    assert "/v1/chat/completions" in message and "GET /openapi.json" in message


def test_a_method_not_allowed_is_405_saying_which_are(http):
    response = http.get("/v1/chat/completions")
    error = _error(response, 405)
    assert response.headers["allow"] == "POST"
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "GET is not allowed on /v1/chat/completions; use POST."


def test_a_models_created_time_is_the_same_on_every_call(http):
    first = http.get("/v1/models").json()["data"][0]["created"]
    time.sleep(1.1)
    assert http.get("/v1/models").json()["data"][0]["created"] == first
    card = http.get(f"/v1/models/{http.get('/v1/models').json()['data'][0]['id']}").json()
    assert card["created"] == first <= time.time()
