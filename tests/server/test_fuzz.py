"""Schemathesis fuzzing of `deltaserve serve` (embedded model, CPU) against its own /openapi.json: no 5xx, no
response that breaks its documented schema, and the server healthy afterwards.

The server's /openapi.json describes every route's request body (server/openapi.py); the test takes it as
served and only bounds `n`, `max_tokens`, `min_tokens`, `logprobs` and the like and fixes `model`, so that
every generated request is cheap; valid bodies (positive mode) and broken ones (negative mode) are both
sent. Bounded: MAX_EXAMPLES per operation and mode (half that for the routes that do not generate),
derandomized, so each run sends the same requests."""

from __future__ import annotations

import copy
from collections import Counter

import httpx
import pytest

from .conftest import ServerProcess
from .live_server import metrics

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytest.importorskip("deltaserve.engine.llm_engine")

MAX_EXAMPLES = 60
SERVED_NAME = "fuzz"
BOUNDS = {"n": (1, 3), "best_of": (1, 3), "max_tokens": (1, 8), "max_completion_tokens": (1, 8),
          "max_output_tokens": (1, 8), "min_tokens": (0, 8), "logprobs": (0, 5), "top_logprobs": (0, 5)}
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(["-m", "deltaserve", "serve", "--device", "cpu", "--max-model-len", "128",
                          "--cpu-cache-bytes", str(32 << 20), "--served-model-name", SERVED_NAME,
                          "--uvicorn-log-level", "warning"],
                         tmp_path_factory.mktemp("fuzz") / "server.log").start()
    yield proc
    proc.stop()


def _bounded(schema: dict) -> dict:
    """A request body's JSON schema with the cost-driving integers bounded and `model` fixed."""
    schema = copy.deepcopy(schema)
    props = schema["properties"]
    for name, (lo, hi) in BOUNDS.items():
        if name in props:
            required = name in schema.get("required", [])
            bounded = {"type": "integer", "minimum": lo, "maximum": hi}
            props[name] = bounded if required else {"anyOf": [bounded, {"type": "null"}]}
    if "model" in props:
        props["model"] = {"const": SERVED_NAME}
    return schema


BODYLESS_POSTS = {"/reset_prefix_cache"}   # POST routes that take no body


def _served_openapi(base: str) -> dict:
    """The app's own /openapi.json, every request body bounded."""
    doc = httpx.get(f"{base}/openapi.json", timeout=10).json()
    components = doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        post = item.get("post")
        if post is None:
            continue
        if "requestBody" not in post:
            assert path in BODYLESS_POSTS, f"/openapi.json has no request body for POST {path}"
            continue
        name = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        components[name] = _bounded(components[name])
    return doc


def test_fuzz_finds_no_server_error_and_the_server_survives(server):
    from schemathesis.checks import not_a_server_error
    from schemathesis.errors import FailureGroup
    from schemathesis.specs.openapi.checks import response_schema_conformance

    schema = schemathesis.openapi.from_dict(_served_openapi(server.base))
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []

    def fuzz(operation, mode) -> None:
        examples = MAX_EXAMPLES if operation.path in GENERATING else MAX_EXAMPLES // 2

        @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck),
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
        @hypothesis.given(operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            response = case.call(base_url=server.base, timeout=60)
            statuses[operation.label, response.status_code] += 1
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            except (AssertionError, FailureGroup) as exc:   # one failed check, or several
                failures.append(f"{operation.label} ({mode.value}): {str(exc)[:800]}")

        run()

    num_operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        num_operations += 1
        fuzz(operation, schemathesis.GenerationMode.POSITIVE)
        if operation.body:
            fuzz(operation, schemathesis.GenerationMode.NEGATIVE)

    assert not failures, "\n\n".join(failures[:5])
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    m = metrics(server.base)
    assert m["deltaserve_requests_total{outcome=error}"] == 0
    assert m["deltaserve_kv_blocks_used"] == 0 and m["deltaserve_state_slots_used"] == 0
    print(f"\nfuzz: {sum(statuses.values())} requests; by operation and status: {dict(statuses)}")
    assert sum(statuses.values()) <= 2 * MAX_EXAMPLES * num_operations
    for path in GENERATING:   # both the engine path and the validation path were reached
        label = f"POST {path}"
        assert statuses[label, 200] > 0 and any(s == 400 for (op, s) in statuses if op == label), statuses
