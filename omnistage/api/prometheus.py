"""Prometheus text exposition (format 0.0.4), written by hand: the families and
samples ``GET /metrics`` builds, and the escaping and number formats they need."""

from __future__ import annotations

import math

from omnistage.dataplane.latency import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = dict[str, str]


class Exposition:
    """Builds the text format: one HELP and TYPE line per family, then its samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self, name: str, type_: str, help_: str, samples: list[tuple[Labels, float]]
    ) -> None:
        self._lines.append(f"# HELP {name} {escape_help(help_)}")
        self._lines.append(f"# TYPE {name} {type_}")
        for labels, value in samples:
            self._lines.append(f"{name}{format_labels(labels)} {format_value(value)}")

    def histogram(self, name: str, help_: str, samples: list[tuple[Labels, Histogram]]) -> None:
        """A histogram family: cumulative ``_bucket`` series up to ``le="+Inf"`` (which
        equals ``_count``), then ``_sum`` and ``_count``, per label set."""
        self._lines.append(f"# HELP {name} {escape_help(help_)}")
        self._lines.append(f"# TYPE {name} histogram")
        for labels, hist in samples:
            for le, n in hist.cumulative():
                bucket = format_labels({**labels, "le": format_value(le)})
                self._lines.append(f"{name}_bucket{bucket} {n}")
            self._lines.append(f"{name}_sum{format_labels(labels)} {format_value(hist.sum)}")
            self._lines.append(f"{name}_count{format_labels(labels)} {hist.count}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items()) + "}"


def format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
