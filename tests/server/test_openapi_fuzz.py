"""schemathesis over the OpenAPI schema a real ``ferry serve`` serves, as served (no
schema patched in by the test): every public operation gets generated bodies, paths and
queries, valid ones and invalid ones, and no answer is a 5xx.

The server is ``--aggregated`` with the default model and ``--max-tokens-limit 4``, so every
generation is short; examples are bounded per operation and mode, and derandomized (the
same requests on every run)."""

from __future__ import annotations

import pytest
import schemathesis
from conftest import assert_sound, run_server
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

EXAMPLES = {"POST": 50, "GET": 10, "DELETE": 10}  # per operation and mode: minutes on 2 cores
OPERATIONS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"),
    ("GET", "/ready"), ("GET", "/metrics"),
]  # fmt: skip


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    log = tmp_path_factory.mktemp("ferry-fuzz") / "serve.log"
    with run_server(log, "--aggregated", "--threads", "1", "--max-tokens-limit", "4") as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(f"{fuzzed.base_url}/openapi.json", timeout=30)


def test_the_schema_lists_exactly_the_public_operations(api_schema):
    served = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert served == set(OPERATIONS)


# invalid input only where there is input to get wrong: the request bodies
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES,
                         ids=[f"{m} {p} {g.value}" for m, p, g in CASES])  # fmt: skip
def test_no_generated_request_gets_a_5xx(api_schema, fuzzed, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[method], deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    def check(case) -> None:
        response = case.call(headers=fuzzed.headers, timeout=120)
        assert response.status_code < 500, (
            f"{response.status_code} {response.text[:400]}\n{case.as_curl_command()[:2000]}"
        )

    check()


def test_the_server_is_healthy_after_the_fuzzing(fuzzed):
    assert fuzzed.process.poll() is None
    assert_sound(fuzzed)
    assert "Traceback" not in fuzzed.log_path.read_text(errors="replace")
