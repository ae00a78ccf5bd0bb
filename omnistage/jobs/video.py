"""Video jobs: one job is one request to the pipeline's video stage.

The stage streams a progress chunk per denoising step, then the first frame as a PNG
(the thumbnail), then the MP4. Both files go to the media store under the job's id; the
job's result names them, with what was made (size, frames, fps, seconds, seed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnistage.jobs.runner import JobFailed, open_patiently
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta, VideoMeta
from omnistage.protocol.enums import Modality
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Prompt
from omnistage.protocol.params import StageParams, VideoParams
from omnistage.service import PipelineService
from omnistage.store.media import MediaStore
from omnistage.store.records import Job, JobKind, JobStatus

_PARAM_FIELDS = (
    "seconds",
    "size",
    "fps",
    "num_frames",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
)


def video_key(job_id: str) -> str:
    return f"videos/{job_id}.mp4"


def thumbnail_key(job_id: str) -> str:
    return f"videos/{job_id}.png"


def input_key(job_id: str) -> str:
    return f"videos/{job_id}.input"


def media_keys(job: Job) -> list[str]:
    return [video_key(job.id), thumbnail_key(job.id), input_key(job.id)]


def video_object(job: Job) -> dict[str, Any]:
    """The job as OpenAI's video object."""
    spec, result = job.request, job.result or {}
    seconds = result.get("seconds", spec.get("seconds"))
    size = (
        f"{result['width']}x{result['height']}" if "width" in result else spec.get("size") or "auto"
    )
    completed = job.status == JobStatus.COMPLETED
    # Videos have no cancelled state in OpenAI's API: a cancelled job reads as failed.
    status = JobStatus.FAILED if job.status == JobStatus.CANCELLED else job.status
    return {
        "id": job.id,
        "object": "video",
        "created_at": int(job.created_at),
        "status": status.value,
        "model": spec.get("model"),
        "progress": 100 if completed else job.progress,
        "seconds": "auto" if seconds is None else f"{float(seconds):g}",
        "size": size,
        "prompt": spec.get("prompt"),
        "completed_at": int(job.completed_at) if job.completed_at else None,
        "expires_at": int(job.expires_at) if job.expires_at else None,
        "error": job.error,
        "remixed_from_video_id": None,
        "seed": spec.get("seed"),
    }


class VideoJobs:
    """The handler of video jobs (see ``jobs.runner.JobHandler``)."""

    kind = JobKind.VIDEO

    def __init__(self, omni: PipelineService, media: MediaStore, stage_id: int) -> None:
        self.omni = omni
        self.media = media
        self.stage_id = stage_id

    async def run(self, job: Job, progress: Callable[[int], None]) -> dict[str, Any]:
        spec = job.request
        images = None
        if spec.get("input_reference"):
            reference = await self.media.get(spec["input_reference"])
            if reference is None:
                raise JobFailed("input_missing", "the uploaded input_reference is gone")
            images = [reference]
        params = VideoParams(
            **{k: spec[k] for k in _PARAM_FIELDS if spec.get(k) is not None}, progress=True
        )
        request = PipelineRequest(
            f"{job.id}-{job.attempts}",
            Prompt(text=spec["prompt"], images=images),
            [self.stage_id],
            stage_params={self.stage_id: StageParams(video=params)},
            only=True,
        )
        stream = await open_patiently(self.omni, request)
        video: tuple[bytes, VideoMeta | None] | None = None
        thumbnail: bytes | None = None
        try:
            async for out in stream:
                meta = out.meta
                if isinstance(meta, ProgressMeta):
                    if meta.steps:
                        progress(meta.step * 100 // meta.steps)
                elif not out.data:
                    continue
                elif isinstance(meta, ImageMeta):
                    thumbnail = out.data
                elif isinstance(meta, VideoMeta) or out.modality == Modality.VIDEO:
                    video = (out.data, meta if isinstance(meta, VideoMeta) else None)
        finally:
            stream.close()
        if video is None:
            raise JobFailed("generation_failed", "the video stage returned no video")
        return await self._keep(job, video, thumbnail)

    async def _keep(
        self, job: Job, video: tuple[bytes, VideoMeta | None], thumbnail: bytes | None
    ) -> dict[str, Any]:
        data, meta = video
        await self.media.put(video_key(job.id), data)
        result: dict[str, Any] = {"video": video_key(job.id), "bytes": len(data)}
        if thumbnail is not None:
            await self.media.put(thumbnail_key(job.id), thumbnail)
            result["thumbnail"] = thumbnail_key(job.id)
        if meta is not None:
            for name in ("width", "height", "frames", "fps", "seed"):
                result[name] = getattr(meta, name)
            if meta.frames and meta.fps:
                result["seconds"] = meta.frames / meta.fps
        return result

    async def discard(self, job: Job) -> None:
        for key in media_keys(job):
            await self.media.delete(key)
