"""``omnistage status``: a running pipeline at a glance, in a terminal.

Reads the head's ``GET /v1/omni/stages`` (and ``GET /metrics`` for the requests waiting
per stage when the JSON lacks them) and renders one frame of text: the pipeline's
health, a line on the live voice sessions once there were any, and each stage. Fetching and
rendering are separate pure-ish functions, so a frame can be tested from captured JSON
without a head; only ``run`` touches the terminal and the clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from omnistage import defaults, envs
from omnistage.protocol.enums import ReplicaState
from omnistage.realtime.stats import quantile

DEFAULT_URL = f"http://127.0.0.1:{defaults.HTTP_PORT}"
FETCH_TIMEOUT_S = 3.0
RECENT_CHANGES = 8

_CLEAR = "\x1b[H\x1b[2J"
_RESET = "\x1b[0m"
_STATE_COLOURS = {
    "UP": "\x1b[32m",
    "STARTING": "\x1b[33m",
    "DRAINING": "\x1b[33m",
    "ERROR": "\x1b[31m",
    "DOWN": "\x1b[2m",
}
# Where a head may list state changes: the top level, or each replica.
_EVENT_KEYS = ("recent_state_changes", "state_changes", "recent_events", "events", "history")
_WAITING_RE = re.compile(r"^omnistage_stage_waiting\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class StatusError(Exception):
    """The head could not be read; the message is one line for the operator."""


class AuthError(StatusError):
    """The head answered 401: the API key is missing or wrong."""


def default_url() -> str:
    return envs.status_url() or DEFAULT_URL


# --------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------


def _get(url: str, api_key: str | None) -> str:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            what = "was refused" if api_key else "is missing"
            raise AuthError(
                f"{url}: 401 Unauthorized: the API key {what} "
                "(pass --api-key KEY or set OMNISTAGE_API_KEY to the head's --api-key)"
            ) from None
        raise StatusError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach the head at {url}: {reason}") from None


def fetch(url: str, api_key: str | None) -> tuple[dict[str, Any], str | None]:
    """The stages JSON, and the /metrics text if the JSON lacks waiting counts (else
    None; also None when /metrics cannot be read, as it is optional)."""
    base = url.rstrip("/")
    body = _get(f"{base}/v1/omni/stages", api_key)
    try:
        stages = json.loads(body)
    except json.JSONDecodeError:
        raise StatusError(f"{base}/v1/omni/stages: not JSON; is this an omnistage head?") from None
    if not isinstance(stages, dict) or not isinstance(stages.get("stages"), list):
        raise StatusError(f"{base}/v1/omni/stages: unexpected shape; is this an omnistage head?")
    if all("waiting" in s for s in stages["stages"]):
        return stages, None
    try:
        return stages, _get(f"{base}/metrics", api_key)
    except StatusError:
        return stages, None


def waiting_from_metrics(metrics_text: str) -> dict[int, float]:
    """``omnistage_stage_waiting`` per stage id, from Prometheus text."""
    waiting: dict[int, float] = {}
    for labels, value in _WAITING_RE.findall(metrics_text):
        fields = dict(_LABEL_RE.findall(labels))
        try:
            waiting[int(fields["stage_id"])] = float(value)
        except (KeyError, ValueError):
            continue
    return waiting


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _paint(text: str, state: str, color: bool) -> str:
    code = _STATE_COLOURS.get(state)
    return f"{code}{text}{_RESET}" if color and code else text


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _count(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return "-" if value is None else str(value)


def _header(data: dict[str, Any], url: str | None, color: bool) -> list[str]:
    stages = data["stages"]
    waiting = [s["name"] for s in stages if s.get("status", "ready") not in ("ready", "restarting")]
    coming = [s["name"] for s in stages if s.get("status") == "restarting"]
    if waiting:
        health = f"unavailable (no live replica: {', '.join(waiting)})"
    elif coming:
        health = f"restarting (no live replica, one coming back: {', '.join(coming)})"
    else:
        health = "ok"
    state = ReplicaState.UP if health == "ok" else ReplicaState.STARTING
    health = _paint(health, ReplicaState.ERROR if waiting else state, color)
    line = f"pipeline {data.get('pipeline', '?')}"
    if url:
        line += f"  {url}"
    extras = []
    if "lb_policy" in data:
        extras.append(f"lb {data['lb_policy']}")
    if "heartbeat_timeout_s" in data:
        extras.append(f"heartbeat timeout {data['heartbeat_timeout_s']:g}s")
    tail = f"  ({', '.join(extras)})" if extras else ""
    return [line, f"health {health}{tail}"]


def _heads(data: dict[str, Any], color: bool) -> list[str]:
    """The fleet's heads (--omni-join), this one first; nothing for a head alone."""
    heads = data.get("heads") or []
    if not heads:
        return []
    parts = []
    for h in heads:
        state = str(h.get("state", "?"))
        where = str(h.get("address", "?")).removeprefix("tcp://")
        mark = " (this)" if h.get("self") else ""
        parts.append(f"{where}{mark} {_paint(state, state, color)}")
    return [f"heads {len(heads)}: " + ", ".join(parts)]


def _live_voice(data: dict[str, Any]) -> list[str]:
    """One line on the live voice sessions, once there has been one (a head without
    them, or that never had a session, shows none)."""
    rt = data.get("realtime")
    if not isinstance(rt, dict) or not rt.get("sessions_total"):
        return []
    line = (
        f"live voice  sessions {_count(rt.get('live_sessions'))} open, "
        f"{_count(rt.get('sessions_total'))} total; turns {_count(rt.get('turns_total'))}; "
        f"barge-ins {_count(rt.get('barge_ins_total'))}"
    )
    hist = rt.get("first_audio_seconds") or {}
    bounds, counts = tuple(hist.get("bounds") or ()), list(hist.get("counts") or ())
    p50, p90 = quantile(bounds, counts, 0.5), quantile(bounds, counts, 0.9)
    if p50 is not None and p90 is not None:
        line += f"; first audio p50 {p50:.2f}s p90 {p90:.2f}s ({sum(counts)} answers)"
    return [line]


def _stage_title(stage: dict[str, Any], names: dict[int, str], waiting: Any) -> str:
    title = f"stage {stage['stage_id']} {stage['name']}"
    inputs = [names.get(i, str(i)) for i in stage.get("inputs", [])]
    if inputs:
        title += f" <- {', '.join(inputs)}"
    parts = [f"engine {stage.get('engine', '?')}"]
    if stage.get("status") == "restarting":
        parts.append("no live replica, one coming back")
    elif stage.get("status", "ready") != "ready":
        parts.append("no live replica")
    if waiting is not None:
        parts.append(f"requests waiting {_count(waiting)}")
    return f"{title}  [{', '.join(parts)}]"


_COLUMNS = ("REPLICA", "ADDRESS", "PID", "STATE", "IN-FLIGHT", "QUEUE", "RESTARTS", "HEARTBEAT")


def _replica_cells(stage: dict[str, Any], r: dict[str, Any]) -> list[str]:
    address = str(r.get("address") or "?") + (" (local)" if r.get("local") else "")
    if r.get("node"):  # placed by Ray: its node id, short as Ray's own CLI shows it
        address += f" node {str(r['node'])[:8]}"
    in_flight = f"{_count(r.get('in_flight'))}/{_count(r.get('capacity'))}"
    age = r.get("last_heartbeat_age_s")
    return [
        f"{stage['name']}/{r.get('replica_id', '?')}",
        address,
        _count(r.get("pid")),
        str(r.get("state", "?")),
        in_flight,
        _count(r.get("queue_length")),
        _count(r.get("restarts")),
        "-" if age is None else f"{_ago(age)} ago",
    ]


def _table(rows: list[list[str]], color: bool) -> list[str]:
    """Aligned columns; the STATE column (index 3) is coloured after padding, so escape
    codes never upset the widths."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row)]
        if n > 0:
            cells[3] = _paint(cells[3], row[3], color)
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _stage_block(
    stage: dict[str, Any], names: dict[int, str], waiting: Any, color: bool
) -> list[str]:
    lines = [_stage_title(stage, names, waiting)]
    replicas = stage.get("replicas", [])
    if not replicas:
        return [*lines, "  (no replicas registered)"]
    rows = [list(_COLUMNS)] + [_replica_cells(stage, r) for r in replicas]
    lines += _table(rows, color)
    for r in replicas:
        if r.get("reason") and r.get("state") != ReplicaState.UP:
            state = _paint(str(r.get("state")), str(r.get("state")), color)
            why = r["reason"] + _restart_note(r.get("restarting"))
            lines.append(f"    {stage['name']}/{r.get('replica_id')} {state}: {why}")
    return lines


def _restart_note(restarting: Any) -> str:
    """What a slot the head restarts (its row's ``restarting``) adds to its reason."""
    if not isinstance(restarting, dict):
        return ""
    left = restarting.get("in_s")
    if isinstance(left, int | float) and left > 0:
        return f"; restarting in {_ago(left)}"
    return "; restarting now"


def _event_age(event: dict[str, Any], now: float) -> float | None:
    for key in ("age_s", "ago_s"):
        if isinstance(event.get(key), int | float):
            return float(event[key])
    for key in ("time", "at", "ts", "timestamp"):
        if isinstance(event.get(key), int | float):
            return now - float(event[key])
    return None


def state_changes(data: dict[str, Any], now: float) -> list[tuple[float | None, str, dict]]:
    """Every state change the JSON reports, as (age in seconds, "stage/replica", event),
    newest first; events without a time come last, in the order given."""
    found: list[tuple[float | None, str, dict]] = []
    names = {s["stage_id"]: s["name"] for s in data["stages"]}
    for key in _EVENT_KEYS:
        for e in data.get(key) or []:
            if isinstance(e, dict):
                stage = e.get("stage") or names.get(e.get("stage_id"), e.get("stage_id", "?"))
                found.append((_event_age(e, now), f"{stage}/{e.get('replica_id', '?')}", e))
    for stage in data["stages"]:
        for r in stage.get("replicas", []):
            for key in _EVENT_KEYS:
                for e in r.get(key) or []:
                    if isinstance(e, dict):
                        who = f"{stage['name']}/{r.get('replica_id', '?')}"
                        found.append((_event_age(e, now), who, e))
    found.sort(key=lambda item: float("inf") if item[0] is None else item[0])
    return found


def _changes_block(data: dict[str, Any], now: float, color: bool) -> list[str]:
    changes = state_changes(data, now)[:RECENT_CHANGES]
    if not changes:
        return []
    lines = ["recent state changes"]
    for age, who, e in changes:
        state = str(e.get("state") or e.get("to") or "?")
        ago = f"{_ago(age)} ago" if age is not None else "-"
        reason = e.get("reason") or e.get("why") or ""
        lines.append(f"  {ago:>9}  {who}  {_paint(state, state, color)}  {reason}".rstrip())
    return lines


def render(
    stages_json: dict[str, Any],
    metrics_text: str | None,
    now: float,
    color: bool,
    url: str | None = None,
) -> str:
    """One frame: header, a block per stage in graph order, then recent state changes.

    ``now`` is wall-clock time (``time.time()``), used for events stamped with a time.
    """
    stages = sorted(stages_json["stages"], key=lambda s: s["stage_id"])
    names = {s["stage_id"]: s["name"] for s in stages}
    from_metrics = waiting_from_metrics(metrics_text) if metrics_text else {}
    lines = _header(stages_json, url, color) + _heads(stages_json, color)
    lines += _live_voice(stages_json)
    for stage in _graph_order(stages):
        waiting = stage.get("waiting", from_metrics.get(stage["stage_id"]))
        lines += ["", *_stage_block(stage, names, waiting, color)]
    changes = _changes_block(stages_json, now, color)
    if changes:
        lines += ["", *changes]
    return "\n".join(lines) + "\n"


def _graph_order(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Upstream stages before the stages they feed; ties (and any cycle) by stage id."""
    ordered: list[dict[str, Any]] = []
    placed: set[int] = set()
    pending = list(stages)
    while pending:
        ready = [s for s in pending if all(i in placed for i in s.get("inputs", []))]
        nxt = ready[0] if ready else pending[0]
        ordered.append(nxt)
        placed.add(nxt["stage_id"])
        pending.remove(nxt)
    return ordered


def render_error(message: str, url: str, now: float, color: bool) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    return f"{url}  {stamp}\n{_paint('error', 'ERROR', color)}: {message}\n"


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def run(url: str, watch: float | None, api_key: str | None) -> int:
    """One frame (exit 0, or 1 with one line on stderr), or a frame every ``watch``
    seconds until Ctrl-C; a 401 ends the watch (retrying cannot help)."""
    tty = sys.stdout.isatty()
    if watch is None:
        try:
            stages, metrics = fetch(url, api_key)
        except StatusError as exc:
            print(f"omnistage status: error: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write(render(stages, metrics, time.time(), tty, url))
        return 0
    # Ctrl-C sets a flag the loop waits on, instead of raising KeyboardInterrupt
    # wherever the interpreter happens to be: one raised inside a __del__ (a closing
    # HTTP response) is swallowed, and the watch would go on.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda _sig, _frame: stop.set())
    try:
        return _watch(url, watch, api_key, tty, stop)
    except BrokenPipeError:  # piped into `head` and the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _watch(url: str, interval: float, api_key: str | None, tty: bool, stop: threading.Event) -> int:
    first = True
    while not stop.is_set():
        try:
            stages, metrics = fetch(url, api_key)
            frame = render(stages, metrics, time.time(), tty, url)
        except AuthError as exc:
            print(f"omnistage status: error: {exc}", file=sys.stderr)
            return 1
        except StatusError as exc:
            frame = render_error(str(exc), url, time.time(), tty)
        if tty:
            sys.stdout.write(_CLEAR + frame)
        else:
            sys.stdout.write(frame if first else "\n" + frame)
        sys.stdout.flush()
        first = False
        stop.wait(interval)
    return 0
