"""The stage DAG of a deploy config, with the queries the orchestrator needs."""

from __future__ import annotations

from omnistage.config.schema import DeployConfig, StageConfig


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
        self.sampling_defaults: dict[int, dict[str, object]] = {
            s.stage_id: dict(s.default_sampling_params) for s in config.stages
        }

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

    def finals_with(self, modalities: set[str]) -> list[int]:
        return [sid for sid in self.final if self.stages[sid].output_modality in modalities]

    def required_for(self, finals: list[int]) -> set[int]:
        """The final stages asked for and every stage they depend on."""
        needed: set[int] = set()
        todo = list(finals)
        while todo:
            sid = todo.pop()
            if sid not in needed:
                needed.add(sid)
                todo.extend(self.inputs[sid])
        return needed
