"""bench.tenant_isolation: the tenants file it writes is one the server loads (its keys pick
the two tenants), and its table puts each cell's light-tenant TTFT beside the one alone."""

from __future__ import annotations

from bench.metrics import Distribution
from bench.tenant_isolation import HEAVY, LIGHT, Cell, medians, table, write_tenants_file
from bench.tenants import TenantReport
from frontend.tenants import load_tenants


def test_the_tenants_file_maps_the_runs_keys_to_its_two_tenants(tmp_path):
    tenants = load_tenants(write_tenants_file(tmp_path))
    assert tenants.for_key("sk-heavy").name == HEAVY
    assert tenants.for_key("sk-light").name == LIGHT
    assert tenants.for_key("sk-other") is None
    assert {tenant.weight for tenant in tenants.tenants} == {1.0}


def report(name: str, p50: float, p99: float, done: int = 10) -> TenantReport:
    return TenantReport(name, 1.0, done, {}, Distribution(p50, p50, p99, p99, p99), 100)


def test_the_table_gives_each_cell_against_the_light_tenant_alone():
    rounds = [[Cell("alone", report(LIGHT, 10.0, 40.0), seconds=10.0),
               Cell("beside heavy, --tenants", report(LIGHT, 15.0, 50.0),
                    report(HEAVY, 0, 0, done=50), seconds=10.0)],
              [Cell("alone", report(LIGHT, 20.0, 40.0), seconds=10.0),
               Cell("beside heavy, --tenants", report(LIGHT, 19.0, 30.0),
                    report(HEAVY, 0, 0, done=50), seconds=10.0)]]
    lines = table(rounds).splitlines()
    assert lines[3] == ("| beside heavy, --tenants | 15.0 | 1.50x | 50.0 | 1.25x | 10 / 0 | 50 "
                        "| 20.0 |")
    assert lines[5].startswith("| beside heavy, --tenants | 19.0 | 0.95x | 30.0 | 0.75x |")
    assert medians(rounds).splitlines() == [
        "alone: light TTFT p50 median 15.0 ms, p99 median 40.0 ms",
        "beside heavy, --tenants: light TTFT p50 median 17.0 ms, p99 median 40.0 ms"]
