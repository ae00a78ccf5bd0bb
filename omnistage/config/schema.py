"""The deploy config: one typed schema, validated at load time and frozen after."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from omnistage.config.devices import NO_PLACEMENT, devices_per_replica, parse_devices
from omnistage.config.engine_args import ENGINE_ARGS
from omnistage.protocol.enums import EngineName, LbPolicy
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import decode, kind_of

Modality = Literal["text", "audio", "image", "video"]
ENGINES = tuple(e.value for e in EngineName)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RaySpec(_Frozen):
    """Where a stage's replicas go under ``--worker-backend ray``: Ray's resource request
    for each replica's actor, and how a stage's replicas spread over the nodes."""

    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    memory_bytes: int | None = Field(default=None, ge=1)
    # Custom resources a node must offer (as given to `ray start --resources`).
    resources: dict[str, float] = Field(default_factory=dict)
    # "spread": put the stage's replicas on different nodes where there is room;
    # "default": Ray's own choice (packs a node until it is half used, then spreads).
    placement: Literal["default", "spread"] = "default"

    @field_validator("resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if amount < 0:
                raise ValueError(f"resource {name!r} must be >= 0, got {amount}")
        return value


# The connectors an edge can take (``omnistage.connectors`` implements each).
CONNECTORS = ("zmq", "shm")
DEFAULT_SHM_SEGMENT_BYTES = 64 * 1024 * 1024


class ConnectorConfig(_Frozen):
    """How one edge's tensor payloads travel replica to replica: ``zmq`` (inline in the
    chunk, on the data plane) or ``shm`` (a shared-memory ring the sender writes once; a
    small descriptor travels on the data plane). ``shm`` falls back to ``zmq`` for two
    replicas that do not share a host's memory."""

    name: str = "zmq"
    # shm: the ring one sending replica keeps per receiving replica. A payload that does
    # not fit (or finds the ring full) travels inline instead.
    segment_bytes: int = Field(default=DEFAULT_SHM_SEGMENT_BYTES, ge=1 << 16, le=1 << 40)
    # Options of connectors added later (a transfer engine's addresses, say).
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known_connector(cls, value: str) -> str:
        if value not in CONNECTORS:
            raise ValueError(
                f"unknown connector {value!r}; expected one of {', '.join(CONNECTORS)}"
            )
        return value


class OmniKvConfig(_Frozen):
    """One edge's connector, as the seed's ``omni_kv_config`` names it: the edge from
    ``omni_from_stage`` to ``omni_to_stage`` (one of them the stage that declares it; a
    missing one is that stage) takes ``connector_config``."""

    connector_config: ConnectorConfig = Field(default_factory=ConnectorConfig)
    omni_from_stage: int | None = Field(default=None, ge=0)
    omni_to_stage: int | None = Field(default=None, ge=0)


DEFAULT_INFLIGHT_TARGET = 4.0


class AutoscalingConfig(_Frozen):
    """A stage's replica count follows its load within [min_replicas, max_replicas]: by
    default in-flight plus waiting requests against ``target_inflight_per_replica``
    (``control.autoscale``); with a latency target, the p90 of a latency over a sliding
    window against that target (``control.latency_autoscale``)."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    # The load one replica should carry: the stage wants ceil(load / this) replicas.
    # In-flight mode only: None there becomes DEFAULT_INFLIGHT_TARGET (see _one_mode).
    target_inflight_per_replica: float | None = Field(default=None, gt=0)
    # How long the load must stay above (below) what the replicas are sized for before
    # replicas are added (one is removed).
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=30.0, ge=0)
    # Latency targets (seconds, p90 over latency_window_s); any one set: latency mode.
    # Which a stage can measure: StageConfig._latency_targets_measurable.
    target_p90_first_token_s: float | None = Field(default=None, gt=0)
    target_p90_first_audio_s: float | None = Field(default=None, gt=0)
    target_p90_queue_wait_s: float | None = Field(default=None, gt=0)
    latency_window_s: float = Field(default=30.0, gt=0)
    # Fewer samples than this in the window never add a replica: one slow request among
    # a handful must not read as a missed target.
    latency_min_samples: int = Field(default=20, ge=1)
    # A missed target is blamed on load (and replicas added) only while requests wait
    # (at the head, or queued in the replicas) or the replicas hold at least this
    # fraction of their capacity (max_inflight_per_replica) in flight.
    busy_fraction: float = Field(default=0.8, gt=0, le=1)

    @property
    def latency_targets(self) -> dict[str, float]:
        """Latency family (``control.latency_autoscale.FAMILIES``) -> target p90 s."""
        targets = {
            "first_token": self.target_p90_first_token_s,
            "first_audio": self.target_p90_first_audio_s,
            "queue_wait": self.target_p90_queue_wait_s,
        }
        return {family: t for family, t in targets.items() if t is not None}

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise _located(
                "max_replicas",
                f"{self.max_replicas} is below min_replicas ({self.min_replicas})",
            )
        return self

    @model_validator(mode="after")
    def _one_mode(self) -> AutoscalingConfig:
        if not self.latency_targets:
            if self.target_inflight_per_replica is None:
                # Filled in, not defaulted, so that the dump says which mode it is and
                # validates again as the same (a replica checks its stage's config).
                object.__setattr__(self, "target_inflight_per_replica", DEFAULT_INFLIGHT_TARGET)
        elif self.target_inflight_per_replica is not None:
            raise _located(
                "target_inflight_per_replica",
                "a stage scales either on in-flight requests or on latency targets: drop "
                "this, or the target_p90_* keys",
            )
        return self

    @property
    def inflight_target(self) -> float:
        """``target_inflight_per_replica`` of an in-flight mode stage."""
        return self.target_inflight_per_replica or DEFAULT_INFLIGHT_TARGET


class StageConfig(_Frozen):
    stage_id: int = Field(ge=0)
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    engine: str
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Replicas the head launches locally for this stage when it runs every stage.
    replicas: int = Field(default=1, ge=0)
    # "cpu" (no placement) or device indices "0,1,2,3" that this stage's replicas on one
    # host share, devices_per_replica each (see omnistage.config.devices).
    devices: str = NO_PLACEMENT
    # Devices one replica needs; None: the engine's tensor x pipeline parallel size, or 1.
    devices_per_replica: int | None = Field(default=None, ge=1)
    inputs: tuple[int, ...] = ()
    # What of the client's input this stage reads itself: a request whose input it can
    # read runs without its upstream stages (a text chat skips the listener in front of
    # the thinker). None: a source stage reads text, a stage with inputs reads nothing.
    prompt_modalities: tuple[Modality, ...] | None = None
    final_output: bool = False
    output_modality: Modality = "text"
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    # Requests one replica works on at once; the head balances within this budget.
    max_inflight_per_replica: int = Field(default=256, ge=1)
    # Placement of each replica's actor under --worker-backend ray (ignored otherwise).
    ray: RaySpec = Field(default_factory=RaySpec)
    # Scale the head's own replicas of this stage with its load; None: a fixed count.
    autoscaling: AutoscalingConfig | None = None
    # How the head balances this stage's replicas (one of --omni-lb-policy's choices);
    # None: --omni-lb-policy. E.g. cache-aware for an llm thinker, the default elsewhere.
    lb_policy: str | None = None
    # Connectors of edges into or out of this stage (default: zmq); see OmniKvConfig.
    omni_kv_config: tuple[OmniKvConfig, ...] = ()

    def edges(self) -> list[tuple[int, int, ConnectorConfig]]:
        """(from, to, connector) of each ``omni_kv_config`` entry, this stage filled in."""
        sid = self.stage_id
        out = []
        for kv in self.omni_kv_config:
            up = sid if kv.omni_from_stage is None else kv.omni_from_stage
            down = sid if kv.omni_to_stage is None else kv.omni_to_stage
            out.append((up, down, kv.connector_config))
        return out

    @field_validator("lb_policy")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        if value is not None and value not in {p.value for p in LbPolicy}:
            raise ValueError(f"unknown policy {value!r}; expected one of {', '.join(LbPolicy)}")
        return value

    @field_validator("devices")
    @classmethod
    def _device_list(cls, value: str) -> str:
        parse_devices(value)  # DevicesError is a ValueError: reported at stages[i].devices
        return value

    @property
    def devices_each(self) -> int:
        """Devices one replica of this stage takes from ``devices``."""
        return devices_per_replica(self.devices_per_replica, self.engine_args)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"unknown engine {value!r}; expected one of {', '.join(ENGINES)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _start_at_min_replicas(cls, data: Any) -> Any:
        # With autoscaling and no ``replicas`` given, a stage starts at its minimum.
        if isinstance(data, dict) and "replicas" not in data:
            scaling = data.get("autoscaling")
            if isinstance(scaling, AutoscalingConfig):
                return {**data, "replicas": scaling.min_replicas}
            if isinstance(scaling, dict) and isinstance(scaling.get("min_replicas"), int):
                return {**data, "replicas": scaling["min_replicas"]}
        return data

    @model_validator(mode="after")
    def _replicas_within_autoscaling(self) -> StageConfig:
        scaling = self.autoscaling
        if scaling is not None and not (
            scaling.min_replicas <= self.replicas <= scaling.max_replicas
        ):
            raise _located(
                "replicas",
                f"{self.replicas} is outside autoscaling's [min_replicas, max_replicas] = "
                f"[{scaling.min_replicas}, {scaling.max_replicas}]; `replicas` is the count "
                "the stage starts with",
            )
        return self

    @model_validator(mode="after")
    def _latency_targets_measurable(self) -> StageConfig:
        # The head times a stage's first token (audio) only on the chunks it receives of
        # a final stage (outputs of others may go replica to replica); queue wait, the
        # time to a dispatch, it times for every stage.
        targets = self.autoscaling.latency_targets if self.autoscaling else {}
        for family, modality in (("first_token", "text"), ("first_audio", "audio")):
            if family in targets and not (self.final_output and self.output_modality == modality):
                raise _located(
                    f"autoscaling.target_p90_{family}_s",
                    f"needs a stage with final_output: true and output_modality: {modality} "
                    f"(stage {self.name!r} has final_output: "
                    f"{str(self.final_output).lower()}, output_modality: "
                    f"{self.output_modality}); target_p90_queue_wait_s suits any stage",
                )
        return self

    @model_validator(mode="after")
    def _check_engine_args(self) -> StageConfig:
        schema = ENGINE_ARGS.get(self.engine)
        if schema is not None:
            try:
                schema.model_validate(self.engine_args)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                raise _located(f"engine_args.{field}", err["msg"]) from None
        return self

    @model_validator(mode="after")
    def _check_sampling_defaults(self) -> StageConfig:
        # Typed as the engine reads them (protocol.params), so a typo'd value fails here.
        try:
            decode(kind_of(self.engine), self.default_sampling_params)
        except BadRequestError as exc:
            where = (
                f"default_sampling_params.{exc.param}" if exc.param else "default_sampling_params"
            )
            raise _located(where, str(exc).removeprefix(f"{exc.param}: ")) from None
        return self

    @property
    def reads_prompt(self) -> tuple[str, ...]:
        if self.prompt_modalities is not None:
            return self.prompt_modalities
        return () if self.inputs else ("text",)

    @field_validator("inputs")
    @classmethod
    def _unique_inputs(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(value)) != len(value):
            raise ValueError("inputs must not repeat a stage id")
        return value


class DeployConfig(_Frozen):
    pipeline: str = Field(min_length=1)
    description: str = ""
    stages: tuple[StageConfig, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_graph(self) -> DeployConfig:
        ids = [s.stage_id for s in self.stages]
        seen: set[int] = set()
        for index, sid in enumerate(ids):
            if sid in seen:
                raise _located(f"stages.{index}.stage_id", f"duplicate stage_id {sid}")
            seen.add(sid)
        for index, stage in enumerate(self.stages):
            for pos, upstream in enumerate(stage.inputs):
                if upstream not in seen:
                    raise _located(
                        f"stages.{index}.inputs.{pos}", f"unknown upstream stage {upstream}"
                    )
                if upstream == stage.stage_id:
                    raise _located(f"stages.{index}.inputs.{pos}", "a stage cannot feed itself")
        _check_acyclic(self.stages)
        _check_connectors(self.stages)
        if not any(s.final_output for s in self.stages):
            raise _located("stages", "no stage has final_output: true")
        return self

    def stage(self, stage_id: int) -> StageConfig:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(stage_id)

    @property
    def stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stages]

    def connectors(self) -> dict[tuple[int, int], ConnectorConfig]:
        """The configured connector of each edge (from, to); edges not named take zmq."""
        return {(up, down): conn for s in self.stages for up, down, conn in s.edges()}


class _LocatedError(ValueError):
    """A model-level check that knows which field is at fault."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


def _located(path: str, message: str) -> _LocatedError:
    return _LocatedError(path, message)


def _check_connectors(stages: tuple[StageConfig, ...]) -> None:
    inputs = {s.stage_id: s.inputs for s in stages}
    seen: dict[tuple[int, int], ConnectorConfig] = {}
    for index, stage in enumerate(stages):
        for pos, (up, down, conn) in enumerate(stage.edges()):
            where = f"stages.{index}.omni_kv_config.{pos}"
            if stage.stage_id not in (up, down):
                raise _located(where, f"names the edge {up} -> {down}, not one of this stage's")
            if up not in inputs.get(down, ()):
                raise _located(where, f"no edge {up} -> {down}: stage {down} has no input {up}")
            if seen.setdefault((up, down), conn) != conn:
                raise _located(where, f"the edge {up} -> {down} is given two connectors")


def _check_acyclic(stages: tuple[StageConfig, ...]) -> None:
    inputs = {s.stage_id: s.inputs for s in stages}
    state: dict[int, int] = {}  # 1 = on the DFS stack, 2 = done

    def visit(sid: int, trail: list[int]) -> None:
        if state.get(sid) == 2:
            return
        if state.get(sid) == 1:
            cycle = " -> ".join(str(s) for s in [*trail[trail.index(sid) :], sid])
            raise _located("stages", f"stage graph has a cycle: {cycle}")
        state[sid] = 1
        for upstream in inputs[sid]:
            visit(upstream, [*trail, sid])
        state[sid] = 2

    for sid in inputs:
        visit(sid, [])
