"""A video's own audio track for an omni thinker (``use_audio_in_video``, which a chat
asks for with ``mm_processor_kwargs: {"use_audio_in_video": true}``, as vLLM-Omni takes
it), prepared as the model's processor prepares it when it loads a video's audio:

- the track decoded with PyAV and resampled to the feature extractor's 16 kHz mono, as
  an ``input_audio`` part is (audio_in.py: faster-whisper's decoder), then made into
  the model's Whisper features, as a spoken input's (with the mask);
- in the prompt, each video's tokens and its track's interleaved by time, between the
  audio start and end marks inside the vision marks
  (``<|vision_bos|><|audio_bos|>V..A..V..A..<|audio_eos|><|vision_eos|>`` for
  Qwen2.5-Omni; Qwen3-Omni's marks are its own). The video's tokens sit at rope time
  positions ``t x seconds per grid x position_id_per_seconds`` (one per temporal
  patch), the audio's at 0, 1, 2, ... Qwen2.5-Omni (``Qwen2_5OmniProcessor``) cuts both
  into chunks of ``position_id_per_seconds x seconds_per_chunk`` positions (2 s) as its
  ``get_chunked_index`` cuts them, chunk j of the video followed by chunk j of the audio;
  Qwen3-Omni (``Qwen3OmniMoeProcessor``) merges the two token by token by position, a
  video token first where they tie;
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


MEL_FRAMES_PER_S = 100  # the Whisper feature extractor's (hop 160 at 16 kHz)


def track(index: int, data: bytes, most_seconds: float = 0.0) -> Any:
    """Video ``index``'s audio track as float32 samples at 16 kHz, mono; a 400 when it
    has none, or when its header says it is longer than ``most_seconds`` (0: no bound):
    checked before decoding, since an hour of track is ~230 MB of samples to refuse."""
    import av
    from faster_whisper.audio import decode_audio

    try:
        with av.open(io.BytesIO(data)) as container:
            heard = bool(container.streams.audio)
            seconds = _seconds(container) if heard else 0.0
        if most_seconds and seconds > most_seconds:
            raise BadRequestError(
                f"video {index}'s audio track lasts {seconds:.0f} s, more than the "
                f"model's context holds ({most_seconds:.0f} s of audio); send a shorter video",
                PARAM,
            )
        samples = decode_audio(io.BytesIO(data), sampling_rate=audio_in.SAMPLE_RATE)
    except (av.error.FFmpegError, IndexError, ValueError, OSError):
        heard, samples = False, None
    if not heard or samples is None or samples.size == 0:
        raise BadRequestError(f"video {index} has no audio track to hear", PARAM)
    return samples


def _seconds(container: Any) -> float:
    """The first audio stream's length from the header (its own, else the file's; 0 when
    neither says)."""
    stream = container.streams.audio[0]
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else 0.0


def most_seconds(most_tokens: int, tokens_per_second: float) -> float:
    """The longest track a context of ``most_tokens`` holds (0: no bound)."""
    return most_tokens / tokens_per_second if most_tokens else 0.0


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


def merged(video: list[float], audio: int) -> str:
    """Qwen3-Omni's order of a video's tokens (at rope time positions ``video``) and its
    track's ``audio`` tokens (at 0, 1, 2, ...): "v" or "a" per token, by position, the
    video's first where they tie."""
    out, a = [], 0
    for position in video:
        while a < audio and a < position:
            out.append("a")
            a += 1
        out.append("v")
    return "".join(out) + "a" * (audio - a)


@dataclass
class Soundtracks:
    """The videos' audio tracks, prepared, and how the model times them."""

    tracks: list[AudioInput]
    per_second: float  # rope positions a second (the thinker's position_id_per_seconds)
    seconds_per_chunk: float  # Qwen2.5-Omni's chunks; 0: Qwen3-Omni's merge

    def placeholder(self, watched: VideoInput) -> str:
        """Each video's tokens interleaved with its track's, by time."""
        start, token, end = watched.marks
        a_start, a_token, a_end = self.tracks[0].marks
        out = []
        for i, (thw, heard) in enumerate(zip(watched.grid.tolist(), self.tracks, strict=True)):
            t, h, w = thw
            step = float(watched.seconds[i]) * self.per_second
            times = [n * step for n in range(t) for _ in range(h * w // watched.merge**2)]
            out += [start, a_start, self._between(times, heard.tokens, token, a_token), a_end, end]
        return "".join(out)

    def _between(self, times: list[float], audio: int, token: str, a_token: str) -> str:
        if not self.seconds_per_chunk:
            return "".join(token if kind == "v" else a_token for kind in merged(times, audio))
        per_chunk = int(self.per_second * self.seconds_per_chunk)
        video, heard = chunk_sizes(times, per_chunk), chunk_sizes(list(range(audio)), per_chunk)
        out = []
        for j in range(max(len(video), len(heard))):
            out.append(token * video[j] if j < len(video) else "")
            out.append(a_token * heard[j] if j < len(heard) else "")
        return "".join(out)


def prepare(extractor: Any, videos: list[bytes], config: Any, most_tokens: int = 0) -> Soundtracks:
    """The tracks of ``videos`` as Qwen2.5-Omni's processor prepares them; ``config``:
    the thinker's (its rope's time scale); ``most_tokens``: the context (a track's
    tokens are a quarter of its mel frames)."""
    longest = most_seconds(most_tokens, MEL_FRAMES_PER_S / 4)
    tracks = [audio_in.prepare(extractor, track(i, data, longest)) for i, data in enumerate(videos)]
    return Soundtracks(
        tracks, float(config.position_id_per_seconds), float(config.seconds_per_chunk)
    )


def prepare_qwen3(
    extractor: Any, videos: list[bytes], config: Any, most_tokens: int = 0
) -> Soundtracks:
    """The tracks of ``videos`` as Qwen3-Omni's processor prepares them; ``config``: the
    thinker's (its audio tower's window, its rope's time scale); ``most_tokens``: the
    context (a track's tokens are 13 per window of ``2 x n_window`` mel frames)."""
    window = config.audio_config.n_window
    longest = most_seconds(most_tokens, 13 * MEL_FRAMES_PER_S / (2 * window))
    tracks = [
        audio_in.prepare_qwen3(extractor, track(i, data, longest), window)
        for i, data in enumerate(videos)
    ]
    return Soundtracks(tracks, float(config.position_id_per_seconds), 0.0)
