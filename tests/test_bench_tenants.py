"""bench.tenants: its --tenant parsing, its per-tenant report, and a short run against the
frontend app (tenants file, fake engine) that counts each tenant's requests and refusals."""

from __future__ import annotations

import argparse
import math
import tomllib

import pytest

from bench.metrics import RequestRecord
from bench.tenants import (
    TenantLoad,
    TenantReport,
    TenantRun,
    backlog_end,
    format_reports,
    parse_args,
    run_all,
    with_shares,
)
from frontend.tenants import parse_tenants
from tests.fake_engine import FrontendHarness
from tests.test_tenants import GOOD, KEY_A, KEY_B


def test_tenant_specs_parse_and_bad_ones_are_refused():
    assert TenantLoad.parse("heavy:sk-1:8") == TenantLoad("heavy", "sk-1", 8.0)
    assert TenantLoad.parse("a:key:with:colons:0.5") == TenantLoad("a", "key:with:colons", 0.5)
    assert math.isinf(TenantLoad.parse("burst:k:inf").rate)
    for bad in ("heavy", "heavy:sk", ":sk:1", "a::1", "a:k:0", "a:k:-2", "a:k:fast", "a:k:nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            TenantLoad.parse(bad)
    with pytest.raises(SystemExit):
        parse_args(["--tenant", "a:k:1", "--tenant", "a:j:2"])


def record(ttft_s: float | None, output_tokens: int, error: str | None = None) -> RequestRecord:
    done = RequestRecord(10, 16, start=1.0, end=2.0, success=error is None, error=error,
                         usage_output_tokens=output_tokens)
    if ttft_s is not None:
        done.chunk_times = [1.0 + ttft_s]
    return done


def test_the_report_gives_ttft_refusals_and_output_shares():
    heavy = TenantReport.of(TenantLoad("heavy", "k", 8), [
        record(0.5, 30), record(1.5, 30), record(None, 0, "HTTP 429: Rate limit reached"),
        record(None, 0, "HTTP 429: Rate limit reached"), record(None, 0, "HTTP 504: late")])
    light = TenantReport.of(TenantLoad("light", "j", 0.4), [record(0.1, 15)])
    reports = with_shares([heavy, light])
    assert heavy.completed == 2 and heavy.refused == {"HTTP 429": 2, "HTTP 504": 1}
    assert heavy.ttft_ms.median == pytest.approx(1000.0)
    assert (heavy.output_share, light.output_share) == (pytest.approx(0.8), pytest.approx(0.2))
    text = format_reports(reports, 10.0)
    assert "HTTP 429: 2, HTTP 504: 1" in text and "80.0%" in text and "100.0" in text


async def test_a_short_run_counts_each_tenants_requests_and_refusals(tokenizer):
    table = parse_tenants(tomllib.loads(GOOD))  # team-a: 2 concurrent at most
    async with FrontendHarness(tokenizer, tenants=table) as harness:
        harness.reply_with("one two three", eos=False)
        harness.engine.step_interval_s = 0.02  # 8 tokens: 0.16 s, so team-a's burst collides
        args = parse_args(["--base-url", str(harness.server.make_url("")).rstrip("/"),
                           "--tenant", f"team-a:{KEY_A}:inf", "--burst", "6",
                           "--tenant", f"team-b:{KEY_B}:inf", "--burst", "6",
                           "--output-len", "8", "--input-len", "4"])
        reports, duration = await run_all(args)
    by_name = {report.name: report for report in reports}
    assert by_name["team-b"].completed == 6 and by_name["team-b"].refused == {}
    team_a = by_name["team-a"]
    assert team_a.refused.get("HTTP 429", 0) >= 1 and team_a.completed >= 2
    assert team_a.completed + team_a.refused["HTTP 429"] == 6
    assert by_name["team-b"].output_tokens == 6 * 8 and duration > 0


def test_the_window_share_counts_only_chunks_received_while_arrivals_went_on():
    """After the arrivals stop, a tenant whose backlog ran out leaves the engine to the
    others: the share under saturation is the one inside the window."""
    two, one = record(None, 4), record(None, 4)
    two.chunk_times = [1.1, 1.2, 1.3, 1.4]  # all inside a window ending at 1.5
    one.chunk_times = [1.2, 1.4, 1.6, 1.8]  # half of it after
    reports = with_shares([TenantReport.of(TenantLoad("two", "k", 1), [two], window_end=1.5),
                           TenantReport.of(TenantLoad("one", "j", 1), [one], window_end=1.5)])
    assert [report.window_chunks for report in reports] == [4, 2]
    assert [report.window_share for report in reports] == [pytest.approx(2 / 3),
                                                          pytest.approx(1 / 3)]
    assert [report.output_share for report in reports] == [0.5, 0.5]


def test_the_window_ends_when_the_first_tenant_has_no_request_left_to_start():
    """After a tenant's last request started, the others share what it leaves: its output
    share past that point says nothing of the weights."""
    early, late = RequestRecord(0, 4), RequestRecord(0, 4)
    early.chunk_times, late.chunk_times = [1.0, 1.1], [2.0, 2.1]
    quick, slow = RequestRecord(0, 4), RequestRecord(0, 4)
    quick.chunk_times, slow.chunk_times = [1.2], [5.0, 5.1]
    runs = [TenantRun(TenantLoad("a", "k", math.inf), [early, late]),
            TenantRun(TenantLoad("b", "j", math.inf), [quick, slow]),
            TenantRun(TenantLoad("idle", "i", 1.0), [RequestRecord(0, 4)])]  # never answered
    assert backlog_end(runs) == 2.0
