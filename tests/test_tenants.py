"""Tenants without a server: the TOML file, key lookup, limits (token buckets, concurrency),
the 401/429 bodies, the deadline header and the admission estimate."""

from __future__ import annotations

import time
import tomllib

import pytest
from prometheus_client import CollectorRegistry

from common.protocol import AddRequest, StepStats
from common.sampling import SamplingParams
from frontend.deadline_admission import PendingPrompt, QueueEstimate
from frontend.errors import APIError
from frontend.request_policy import RequestPolicy, parse_timeout
from frontend.tenant_gate import TenantGate
from frontend.tenant_limits import TenantUsage
from frontend.tenants import Tenant, TenantsFileError, key_digest, load_tenants, parse_tenants
from launch import parse_args

KEY_A, KEY_B = "sk-team-a", "sk-team-b"
GOOD = f"""
[tenants.team-a]
key_sha256 = "{key_digest(KEY_A)}"
weight = 2
max_concurrent_requests = 2
input_tokens_per_minute = 600
output_tokens_per_minute = 120

[tenants.team-b]
key_sha256 = ["{key_digest(KEY_B)}", "{key_digest("sk-old-b")}"]
"""


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_good_file_parses_with_defaults(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    table = load_tenants(path)
    assert [t.name for t in table.tenants] == ["team-a", "team-b"]
    team_a = table.for_key(KEY_A)
    assert team_a is not None and team_a.weight == 2.0 and team_a.max_concurrent_requests == 2
    assert (team_a.input_tokens_per_minute, team_a.output_tokens_per_minute) == (600, 120)
    team_b = table.for_key("sk-old-b")
    assert team_b is not None and team_b.name == "team-b" and team_b.weight == 1.0
    assert team_b.max_concurrent_requests is None and team_b.input_tokens_per_minute is None
    assert table.for_key("sk-nobody") is None and table.for_key(key_digest(KEY_A)) is None


DIGEST = key_digest("k")
BAD_FILES = {
    "not toml": ("[tenants.a\nkey = 1", "not valid TOML"),
    "no tenants": ("", "no tenants"),
    "stray key": (f'other = 1\n[tenants.a]\nkey_sha256 = "{DIGEST}"', "unknown top-level"),
    "no key": ("[tenants.a]\nweight = 1", "key_sha256 is required"),
    "plain key": ('[tenants.a]\nkey_sha256 = "sk-plain"', "64 hex digits"),
    "zero weight": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\nweight = 0', "weight must be"),
    "bool weight": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\nweight = true', "weight must be"),
    "fractional cap": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\nmax_concurrent_requests = 1.5',
                       "max_concurrent_requests must be"),
    "zero budget": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\ninput_tokens_per_minute = 0',
                    "input_tokens_per_minute must be"),
    "typo": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\nwieght = 2', "unknown field"),
    "bad name": (f'[tenants."a b"]\nkey_sha256 = "{DIGEST}"', "a name is"),
    "shared key": (f'[tenants.a]\nkey_sha256 = "{DIGEST}"\n[tenants.b]\nkey_sha256 = "{DIGEST}"',
                   "share a key"),
}


@pytest.mark.parametrize(("text", "message"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_file_names_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(TenantsFileError, match=message):
        load_tenants(path)


def test_launch_refuses_a_bad_file_a_missing_one_and_an_api_key_beside_it(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.delenv("LOOM_API_KEY", raising=False)
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.a]\nweight = 1")
    for argv, message in [(["--tenants", str(bad)], "key_sha256 is required"),
                          (["--tenants", str(tmp_path / "none.toml")], "cannot read it"),
                          (["--tenants", str(bad), "--api-key", "k"], "exclusive")]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    assert parse_args(["--tenants", str(good)]).tenant_table.for_key(KEY_A).name == "team-a"
    assert parse_args([]).tenant_table is None


def usage_of(clock: FakeClock, **limits) -> TenantUsage:
    return TenantUsage(Tenant("t", (DIGEST,), **limits), clock)


def assert_rate_limited(error: APIError, limit: str, retry_after: int) -> None:
    assert error.status == 429 and error.headers == {"Retry-After": str(retry_after)}
    body = error.body()["error"]
    assert body["code"] == "rate_limit_exceeded" and body["param"] == limit
    assert limit in body["message"] and "'t'" in body["message"]


def test_the_concurrency_cap_is_a_429_until_a_request_finishes():
    usage = usage_of(FakeClock(), max_concurrent_requests=2)
    usage.start()
    usage.start()
    with pytest.raises(APIError) as error:
        usage.start()
    assert_rate_limited(error.value, "max_concurrent_requests", 1)
    assert error.value.body()["error"]["type"] == "requests"
    usage.finish()
    usage.start()


def test_the_prompt_budget_refills_over_the_minute():
    clock = FakeClock()
    usage = usage_of(clock, input_tokens_per_minute=600)  # 10 tokens a second
    usage.take_prompt_tokens(550)
    with pytest.raises(APIError) as error:
        usage.take_prompt_tokens(100)  # 50 left: 5 s until 100
    assert_rate_limited(error.value, "input_tokens_per_minute", 5)
    assert error.value.body()["error"]["type"] == "tokens"
    clock.now += 5.0
    usage.take_prompt_tokens(100)


def test_a_prompt_larger_than_the_budget_runs_on_a_full_bucket_and_then_blocks_starts():
    clock = FakeClock()
    usage = usage_of(clock, input_tokens_per_minute=600)
    usage.take_prompt_tokens(900)  # a full bucket lets it through, 300 into debt
    with pytest.raises(APIError) as error:
        usage.start()
    assert_rate_limited(error.value, "input_tokens_per_minute", 31)  # 301 tokens at 10/s
    clock.now += 31.0
    usage.start()


def test_output_tokens_count_as_generated_and_overdrawing_blocks_the_next_request():
    clock = FakeClock()
    usage = usage_of(clock, output_tokens_per_minute=120)  # 2 tokens a second
    usage.start()
    usage.generated(100)
    usage.generated(30)  # a running request is never cut: 10 into debt
    usage.finish()
    with pytest.raises(APIError) as error:
        usage.start()
    assert_rate_limited(error.value, "output_tokens_per_minute", 6)  # 11 tokens at 2/s
    clock.now += 5.5
    usage.start()


def test_the_gate_gives_401s_and_counts_by_tenant():
    registry = CollectorRegistry()
    gate = TenantGate.create(parse_tenants(tomllib.loads(GOOD)), registry)
    for key, message in [(None, "Missing API key"), ("", "Missing API key"),
                         ("sk-nobody", "Incorrect API key")]:
        with pytest.raises(APIError) as error:
            gate.identify(key)
        assert error.value.status == 401 and message in error.value.message
        assert error.value.body()["error"]["code"] == "invalid_api_key"
    usage = gate.identify(KEY_A)
    for _ in range(2):
        gate.start(usage)
    with pytest.raises(APIError):
        gate.start(usage)
    gate.take_prompt_tokens(usage, 40)
    gate.generated(usage, 7)
    sample = registry.get_sample_value
    assert sample("loom:tenant_requests_total", {"tenant": "team-a"}) == 2
    assert sample("loom:tenant_requests_rejected_total",
                  {"tenant": "team-a", "limit": "max_concurrent_requests"}) == 1
    assert sample("loom:tenant_requests_running", {"tenant": "team-a"}) == 2
    assert sample("loom:tenant_prompt_tokens_total", {"tenant": "team-a"}) == 40
    assert sample("loom:tenant_generation_tokens_total", {"tenant": "team-a"}) == 7
    assert sample("loom:tenant_requests_total", {"tenant": "team-b"}) == 0


def test_a_tenant_within_its_weighted_share_of_the_open_requests():
    """team-a weighs 2, team-b 1: team-a's share is two thirds of all open requests."""
    gate = TenantGate.create(parse_tenants(tomllib.loads(GOOD)), CollectorRegistry())
    a, b = gate.identify(KEY_A), gate.identify(KEY_B)
    for _ in range(5):
        gate.start(b)
    assert not gate.within_share(b)  # alone but for its own, past its third of them
    gate.start(a)
    assert gate.within_share(a)
    a.num_running = 10  # (past team-a's concurrency cap, set directly)
    assert gate.within_share(a) and gate.within_share(b)  # 10 of 15 and 5 of 15: at them
    a.num_running = 11
    assert not gate.within_share(a) and gate.within_share(b)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "86401", ""])
def test_a_bad_timeout_header_is_a_400(value):
    with pytest.raises(APIError) as error:
        parse_timeout(value)
    assert error.value.status == 400 and error.value.param == "X-Request-Timeout"


def test_a_good_timeout_header_is_seconds():
    assert parse_timeout("2.5") == 2.5 and parse_timeout(None) is None


def request_of(request_id: str, tenant: str, weight: float, tokens: int) -> AddRequest:
    return AddRequest(request_id, [1] * tokens, SamplingParams(), 0.0, tenant=tenant,
                      tenant_weight=weight)


def test_the_admission_estimate_counts_the_prompts_fair_share_serves_first():
    queue = QueueEstimate()
    mine = PendingPrompt("b", 1.0, 100)
    assert queue.wait_s(mine) is None  # nothing measured: never refuse
    for _ in range(4):  # 1,000 prompt tokens per second while requests waited
        queue.observe_step(StepStats(num_waiting=3, num_prompt_tokens=100, step_time_s=0.1))
    queue.observe_step(StepStats(num_waiting=0, num_prompt_tokens=0, step_time_s=5.0))  # idle
    queue.sent(request_of("a1", "a", 2.0, 5000))
    queue.sent(request_of("b1", "b", 1.0, 200))
    # b's 200 waiting + 100 own; a, at twice b's weight, gets 600 served meanwhile.
    assert queue.tokens_ahead(mine) == 900
    assert queue.wait_s(mine) == pytest.approx(0.9)
    queue.check(mine, 1.0)
    with pytest.raises(APIError) as error:
        queue.check(mine, 0.5)
    assert error.value.status == 503 and error.value.headers == {"Retry-After": "1"}
    assert error.value.code == "deadline_unattainable"
    queue.started("a1")
    assert queue.tokens_ahead(mine) == 300
    queue.check(mine, None)  # no deadline: never refused


def test_a_deadline_already_past_before_sending_is_a_504_and_the_rest_is_time_left():
    now = time.monotonic()
    assert RequestPolicy(deadline=now + 30.0, timeout_s=30.0).remaining_s() <= 30.0
    assert RequestPolicy().remaining_s() is None
    with pytest.raises(APIError) as error:
        RequestPolicy(deadline=now - 0.1, timeout_s=2.0).remaining_s()
    assert error.value.status == 504 and error.value.code == "deadline_exceeded"
    assert "X-Request-Timeout" in error.value.message
