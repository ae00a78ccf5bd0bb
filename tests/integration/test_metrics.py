"""GET /metrics: Prometheus text format 0.0.4 from a live head."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.integration.harness import HeadProc

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """A strict little parser of the text format: returns {family: type} and samples.

    Fails on anything malformed: a sample before its family's TYPE line, a TYPE given
    twice, bad label syntax or escaping, a value that is not a float, no final newline.
    """
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helped: set[str] = set()
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped, f"HELP twice for {name}"
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, type_ = line.split(" ")
            assert name not in types, f"TYPE twice for {name}"
            assert type_ in ("counter", "gauge", "histogram", "summary", "untyped")
            types[name] = type_
            continue
        assert line and not line.startswith("#"), f"unexpected line {line!r}"
        m = _SAMPLE.match(line)
        assert m, f"malformed sample {line!r}"
        name, raw_labels, value = m.groups()
        family = _histogram_family(name, types)
        assert family in types, f"sample {name} before its TYPE line"
        labels: list[tuple[str, str]] = []
        pos = 0
        while raw_labels and pos < len(raw_labels):
            lm = _LABEL.match(raw_labels, pos)
            assert lm, f"bad labels in {line!r}"
            unescaped = _UNESCAPE.sub(lambda e: "\n" if e[1] == "n" else e[1], lm[2])
            labels.append((lm[1], unescaped))
            pos = lm.end()
        key = (name, frozenset(labels))
        assert key not in samples, f"duplicate series {line!r}"
        samples[key] = float(value)
    assert helped == set(types), "every family has HELP and TYPE"
    return types, samples


def _histogram_family(name: str, types: dict[str, str]) -> str:
    """The family of a histogram's ``_bucket``, ``_sum`` or ``_count`` sample, else
    ``name`` itself."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and types.get(base) == "histogram":
            return base
    return name


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def scrape(client: httpx.Client) -> tuple[dict[str, str], Samples]:
    r = client.get("/metrics")
    assert r.status_code == 200
    content_type = r.headers["content-type"]
    assert content_type.startswith("text/plain")
    assert "version=0.0.4" in content_type
    return parse(r.text)


def test_metrics_parse_and_count_requests(echo_head: HeadProc) -> None:
    types, before = scrape(echo_head.client)
    assert types["omnistage_requests_started_total"] == "counter"
    assert types["omnistage_requests_in_flight"] == "gauge"
    assert types["omnistage_replicas"] == "gauge"
    assert types["omnistage_replica_dispatched_total"] == "counter"
    for stage_id, stage in enumerate(("thinker", "talker", "vocoder")):
        up = value(before, "omnistage_replicas", stage_id=str(stage_id), stage=stage, state="UP")
        assert up == 1

    for i in range(3):
        assert echo_head.chat(f"hello {i}").status_code == 200
    r = echo_head.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400

    _, after = scrape(echo_head.client)
    started = "omnistage_requests_started_total"
    assert value(after, started) >= value(before, started) + 3
    assert value(after, "omnistage_requests_in_flight") == 0
    replica = {"stage_id": "2", "stage": "vocoder", "replica": "0"}
    dispatched = "omnistage_replica_dispatched_total"
    assert value(after, dispatched, **replica) >= value(before, dispatched, **replica) + 3
    assert value(after, "omnistage_replica_in_flight", **replica) == 0
    assert value(after, "omnistage_replica_up", **replica) == 1
    responses = "omnistage_http_responses_total"
    assert value(after, responses, code="200") >= 4  # three chats and the first scrape
    assert value(after, responses, code="400") >= 1


def test_metrics_stay_open_with_an_api_key(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--api-key", "k")
    try:
        head.wait_healthy()
        assert head.client.get("/v1/models").status_code == 401
        _, samples = scrape(head.client)
        assert value(samples, "omnistage_http_responses_total", code="401") == 1
        ok = head.client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
    finally:
        head.stop()
