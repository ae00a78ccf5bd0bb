"""The stage DAG of a deploy config, with the queries the orchestrator needs."""

from __future__ import annotations

from omnistage.config.schema import DeployConfig, StageConfig
from omnistage.protocol.enums import Modality
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.params import ParamKind, StageParams, decode, kind_of


class StageGraph:
    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.stages: dict[int, StageConfig] = {s.stage_id: s for s in config.stages}
        self.downstream: dict[int, list[int]] = {sid: [] for sid in self.stages}
        for stage in config.stages:
            for upstream in stage.inputs:
                self.downstream[upstream].append(stage.stage_id)
        self.final = [s.stage_id for s in config.stages if s.final_output]
        # Plain copies of what the orchestrator reads per request (pydantic attribute
        # access costs more than a dict lookup on that path).
        self.inputs: dict[int, tuple[int, ...]] = {s.stage_id: s.inputs for s in config.stages}
        # The stages' ``default_sampling_params``, typed as their engines read them;
        # stages without any are left out (the common case costs one lookup).
        typed = (
            (s.stage_id, decode(kind_of(s.engine), s.default_sampling_params))
            for s in config.stages
        )
        self.param_defaults: dict[int, StageParams] = {
            sid: params for sid, params in typed if not params.empty
        }
        self.reads_prompt: dict[int, frozenset[str]] = {
            s.stage_id: frozenset(s.reads_prompt) for s in config.stages
        }
        # Edges (from, to) whose config names a connector (``omni_kv_config``): they
        # carry tensors, and go replica to replica even out of a final stage.
        self.tensor_edges: frozenset[tuple[int, int]] = frozenset(config.connectors())

    def params_for(self, sid: int, request: PipelineRequest) -> StageParams:
        """The stage's defaults, under the request's params, under its params for this
        stage alone."""
        extra = request.stage_params.get(sid) if request.stage_params else None
        defaults = self.param_defaults.get(sid)
        if defaults is None:
            return request.params if extra is None else request.params.merged(extra)
        return defaults.merged(request.params).merged(extra)

    def topological(self) -> list[int]:
        """Every stage id, each after all of its inputs (the config is acyclic)."""
        order: list[int] = []
        placed: set[int] = set()
        while len(order) < len(self.stages):
            for sid in sorted(self.stages):
                if sid not in placed and placed.issuperset(self.inputs[sid]):
                    order.append(sid)
                    placed.add(sid)
        return order

    def upstream(self, stage_id: int) -> tuple[int, ...]:
        return self.inputs[stage_id]

    def stages_reading(self, modality: Modality) -> list[int]:
        return [sid for sid, kinds in self.reads_prompt.items() if modality in kinds]

    def speaking_for(self, audio: list[int]) -> set[int]:
        """The stages that take an answer's voice: the audio stages ``audio``, and the
        speech stages they need (an omni model's talker speaks in the voice its
        code-to-wave stage renders)."""
        needed = self.required_for(audio)
        speech = {sid for sid in needed if kind_of(self.stages[sid].engine) == ParamKind.SPEECH}
        return set(audio) | speech

    def finals_with(self, modalities: set[Modality]) -> list[int]:
        return [sid for sid in self.final if self.stages[sid].output_modality in modalities]

    def required_for(self, finals: list[int], given: frozenset[str] = frozenset()) -> set[int]:
        """The final stages asked for and every stage they need, given the modalities of
        the client's input: a stage that reads all of ``given`` itself runs without its
        upstream stages; otherwise they run (and read what it cannot). With nothing
        given, every upstream stage is needed."""
        needed: set[int] = set()
        todo = list(finals)
        while todo:
            sid = todo.pop()
            if sid in needed:
                continue
            needed.add(sid)
            if given and given <= self.reads_prompt[sid]:
                continue
            todo.extend(self.inputs[sid])
        return needed

    def prompt_for(self, sid: int, active_upstream: bool) -> bool:
        """Whether stage ``sid`` gets the client's prompt: a source always; a stage fed by
        upstream stages too when it reads part of the client's input itself."""
        return not active_upstream or bool(self.reads_prompt[sid])
