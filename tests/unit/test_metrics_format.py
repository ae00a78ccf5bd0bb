"""The hand-written Prometheus text format of /metrics."""

from __future__ import annotations

from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.api.prometheus import Exposition, format_value
from tests.unit.fakes import FakeService


def test_label_values_and_help_are_escaped() -> None:
    out = Exposition()
    out.family("x_total", "counter", 'a \\ b\nc "d"', [({"l": 'q"\\\nz'}, 3)])
    assert out.text() == (
        '# HELP x_total a \\\\ b\\nc "d"\n# TYPE x_total counter\nx_total{l="q\\"\\\\\\nz"} 3\n'
    )


def test_values() -> None:
    assert format_value(True) == "1"
    assert format_value(7) == "7"
    assert format_value(0.5) == "0.5"
    assert format_value(float("inf")) == "+Inf"
    assert format_value(float("-inf")) == "-Inf"
    assert format_value(float("nan")) == "NaN"


def test_a_head_with_no_replicas_yet_renders_every_family() -> None:
    # Before any replica registers: zero counts, the per-state series still listed.
    head = FakeService(stages=((0, "only"),))
    with TestClient(create_app(head)) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'omnistage_info{version="' in r.text
    assert "omnistage_requests_started_total 0" in r.text
    assert 'omnistage_replicas{stage_id="0",stage="only",state="UP"} 0' in r.text
