"""Per-engine argument schemas, checked when the deploy config loads.

Kept free of engine imports so validating a config never loads torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EchoArgs(_Args):
    # How many chunks a source stage splits its prompt into.
    num_chunks: int = Field(default=4, ge=1, le=10_000)
    # Sleep before each chunk (seconds) and busy CPU per chunk (milliseconds).
    chunk_delay_s: float = Field(default=0.0, ge=0.0, le=60.0)
    cpu_cost_ms: float = Field(default=0.0, ge=0.0, le=60_000.0)
    # Appended to the output, default " [<stage name>]".
    suffix: str | None = None
    # Fail every request whose input contains this marker (to test error paths).
    fail_on: str | None = None


ENGINE_ARGS: dict[str, type[_Args]] = {"echo": EchoArgs}
