"""Background responses: a Responses API request (``background: true``) run as a job.

The route stored the response queued and the request, with the conversation it
continues already resolved; the job runs it to its final response object and stores
that (in_progress while it runs). A failed run is stored as a failed response; a
cancelled one keeps the cancelled status the cancel route stored.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from omnistage.api.response_audio import audio_plan
from omnistage.api.response_items import ResponseShape
from omnistage.api.response_runs import pipeline_request, run_to_final
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.jobs.runner import JobFailed, open_patiently
from omnistage.service import PipelineService
from omnistage.store.base import Store
from omnistage.store.records import Job, JobKind, ResponseStatus


class ResponseJobs:
    """The handler of background responses (see ``jobs.runner.JobHandler``)."""

    kind = JobKind.RESPONSE

    def __init__(self, omni: PipelineService, store: Store, stage_id: int) -> None:
        self.omni = omni
        self.store = store
        self.stage_id = stage_id

    async def run(self, job: Job, progress: Callable[[int], None]) -> dict[str, Any]:
        spec = job.request
        body = ResponsesRequest.model_validate(spec["body"])
        shape_fields = dict(spec["shape"])
        created, model = shape_fields.pop("created_at"), shape_fields.pop("model")
        shape = ResponseShape(job.id, int(created), model, shape_fields)
        stored = await self.store.get_response(job.id, job.owner)
        if stored is None:
            raise JobFailed("not_found", "the stored response was deleted")
        stored.status = ResponseStatus.IN_PROGRESS
        stored.body = shape.body(ResponseStatus.IN_PROGRESS)
        await self.store.put_response(stored)
        audio = audio_plan(self.omni, body)
        request = pipeline_request(
            self.omni, body, self.stage_id, f"{job.id}-{job.attempts}", spec["conversation"], audio
        )
        name = self.omni.graph.stages[self.stage_id].name
        opener = partial(open_patiently, self.omni)
        final = await run_to_final(opener, request, shape, name, audio)
        # Cancelled or deleted meanwhile: the runner finds the lease gone and keeps
        # nothing; the stored row must not be overwritten either.
        current = await self.store.get_response(job.id, job.owner)
        if current is None or current.status == ResponseStatus.CANCELLED:
            raise JobFailed("cancelled", "the response was cancelled")
        stored.status, stored.body = ResponseStatus(final["status"]), final
        await self.store.put_response(stored)
        if stored.status == ResponseStatus.FAILED:
            raise JobFailed("generation_failed", str((final.get("error") or {}).get("message")))
        return {"status": final["status"]}

    async def discard(self, job: Job) -> None:
        pass  # a response keeps nothing in the media store
