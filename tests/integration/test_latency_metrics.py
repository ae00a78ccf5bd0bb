"""Latency histograms in GET /metrics from a live echo head, alone and behind API servers
(whose /metrics shows the head's histograms from its snapshot)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.harness import HeadProc, wait_for
from tests.integration.test_metrics import Samples, scrape

STAGES = ("thinker", "talker", "vocoder")
PER_STAGE = (
    "omnistage_stage_queue_wait_seconds",
    "omnistage_stage_first_output_seconds",
    "omnistage_stage_duration_seconds",
)
REQUESTS = 3


def _total(samples: Samples, name: str, **labels: str) -> float:
    """Summed over every series of ``name`` that has ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _check_histograms(types: dict[str, str], samples: Samples) -> None:
    for name in PER_STAGE:
        assert types[name] == "histogram"
        for sid, stage in enumerate(STAGES):
            labels = {"stage_id": str(sid), "stage": stage}
            assert _total(samples, f"{name}_count", **labels) == REQUESTS, (name, stage)
            inf = _total(samples, f"{name}_bucket", le="+Inf", **labels)
            assert inf == REQUESTS, (name, stage)
            if name != "omnistage_stage_queue_wait_seconds":  # free replicas: near 0
                assert _total(samples, f"{name}_sum", **labels) > 0, (name, stage)
    e2e = "omnistage_request_e2e_seconds"
    assert types[e2e] == "histogram"
    assert _total(samples, f"{e2e}_count") == REQUESTS
    assert _total(samples, f"{e2e}_sum") > 0
    assert _total(samples, "omnistage_request_time_to_first_token_seconds_count") == REQUESTS
    assert _total(samples, "omnistage_completion_tokens_total") > 0


def _chat(head: HeadProc) -> None:
    for i in range(REQUESTS):
        r = head.chat(f"hello {i}", stage_params={"0": {"num_chunks": 2}})
        assert r.status_code == 200, r.text


def test_histograms_count_each_request_once_per_stage(echo_head: HeadProc) -> None:
    _chat(echo_head)
    _check_histograms(*scrape(echo_head.client))


def test_api_servers_show_the_heads_histograms(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--api-server-count", "2", name="fronted-latency")
    try:
        head.wait_healthy()
        _chat(head)

        def caught_up() -> bool:  # the snapshot is at most 0.5 s old
            _, samples = scrape(head.client)
            return _total(samples, "omnistage_request_e2e_seconds_count") == REQUESTS

        wait_for(caught_up, 5, 0.1, "the head's histograms in an API server's /metrics")
        _check_histograms(*scrape(head.client))
    finally:
        head.stop()
