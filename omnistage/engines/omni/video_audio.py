"""A video's own audio track for Qwen2.5-Omni's thinker (``use_audio_in_video``, which a
chat asks for with ``mm_processor_kwargs: {"use_audio_in_video": true}``, as vLLM-Omni
takes it), prepared as ``Qwen2_5OmniProcessor`` prepares it when it loads a video's
audio:

- the track decoded with PyAV and resampled to the feature extractor's 16 kHz mono, as
  an ``input_audio`` part is (audio_in.py: faster-whisper's decoder), then made into
  the same Whisper features (padded to 30 s, with the mask);
- in the prompt, each video's tokens and its track's interleaved by time: the video's
  tokens sit at rope time positions ``t x seconds per grid x position_id_per_seconds``
  (one per temporal patch), the audio's at 0, 1, 2, ... (25 a second); both are cut into
  chunks of ``position_id_per_seconds x seconds_per_chunk`` positions (2 s) as the
  processor's ``get_chunked_index`` cuts them, and chunk j of the video is followed by
  chunk j of the audio, all between the audio start and end marks, inside the vision
  marks: ``<|vision_bos|><|audio_bos|>V..A..V..A..<|audio_eos|><|vision_eos|>``;
- the tracks' features follow the spoken input's (if any), in the order of the videos:
  the thinker's ``get_rope_index`` takes the audio lengths in prompt order.

The thinker's own ``get_rope_index(..., use_audio_in_video=True)`` reads that layout.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from omnistage.engines.omni import audio_in
from omnistage.engines.omni.audio_in import AudioInput
from omnistage.engines.omni.video_in import VideoInput
from omnistage.protocol.errors import BadRequestError

PARAM = "mm_processor_kwargs.use_audio_in_video"  # what a 400 about a track names


def track(index: int, data: bytes) -> Any:
    """Video ``index``'s audio track as float32 samples at 16 kHz, mono; a 400 when it
    has none."""
    import av
    from faster_whisper.audio import decode_audio

    try:
        with av.open(io.BytesIO(data)) as container:
            heard = bool(container.streams.audio)
        samples = decode_audio(io.BytesIO(data), sampling_rate=audio_in.SAMPLE_RATE)
    except (av.error.FFmpegError, IndexError, ValueError, OSError):
        heard, samples = False, None
    if not heard or samples is None or samples.size == 0:
        raise BadRequestError(f"video {index} has no audio track to hear", PARAM)
    return samples


def chunk_sizes(positions: list[float], per_chunk: int) -> list[int]:
    """How many of ``positions`` (non-decreasing) fall in each chunk, as
    ``Qwen2_5OmniProcessor.get_chunked_index`` cuts them: a chunk ends at the first
    position at or past the next multiple of ``per_chunk``, and the next one starts
    there (one chunk per crossing, however far the position jumps)."""
    sizes, start, chunk = [], 0, 1
    for i, position in enumerate(positions):
        if position >= chunk * per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(positions) - start)
    return sizes


@dataclass
class Soundtracks:
    """The videos' audio tracks, prepared, and how the model times them."""

    tracks: list[AudioInput]
    per_second: float  # rope positions a second (the thinker's position_id_per_seconds)
    seconds_per_chunk: float

    def placeholder(self, watched: VideoInput) -> str:
        """Each video's tokens interleaved with its track's, by time chunks."""
        start, token, end = watched.marks
        a_start, a_token, a_end = self.tracks[0].marks
        per_chunk = int(self.per_second * self.seconds_per_chunk)
        out = []
        for i, (thw, heard) in enumerate(zip(watched.grid.tolist(), self.tracks, strict=True)):
            t, h, w = thw
            per_frame = h * w // watched.merge**2
            step = float(watched.seconds[i]) * self.per_second
            video = chunk_sizes([n * step for n in range(t) for _ in range(per_frame)], per_chunk)
            audio = chunk_sizes(list(range(heard.tokens)), per_chunk)
            out.append(start + a_start)
            for j in range(max(len(video), len(audio))):
                out.append(token * video[j] if j < len(video) else "")
                out.append(a_token * audio[j] if j < len(audio) else "")
            out.append(a_end + end)
        return "".join(out)


def prepare(extractor: Any, videos: list[bytes], config: Any) -> Soundtracks:
    """The tracks of ``videos`` as Qwen2.5-Omni's processor prepares them; ``config``:
    the thinker's (its rope's time scale)."""
    tracks = [audio_in.prepare(extractor, track(i, data)) for i, data in enumerate(videos)]
    return Soundtracks(
        tracks, float(config.position_id_per_seconds), float(config.seconds_per_chunk)
    )
