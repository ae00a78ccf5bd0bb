"""Token2wav in chunks, so audio leaves while the talker still talks.

transformers' token2wav decodes a whole utterance at once: its DiT draws a mel spectrogram
from noise for every frame (an ODE over ``num_steps``), then BigVGAN turns the mel into a
waveform. Both look only nearby: the DiT attends within blocks (``block_size`` frames) and a
block or two around, BigVGAN is convolutional. So a chunk of codes decoded with a margin of
codes on each side (``past``, ``future``) gives nearly the frames the whole decode gives, and
a chunk of mel vocoded with a margin of frames nearly the samples.

What stays exact: the noise. Every frame's starting noise is the whole utterance's noise at
that frame (``noise``: one draw, from the seed, as long as the longest utterance), so a
chunk differs from the whole decode only by what its margins leave out. ``sample`` is
``Qwen2_5OmniToken2WavDiTModel.sample`` with the noise given instead of drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Window:
    """Codes ``[lo, hi)`` decoded to give codes ``[start, end)``'s audio."""

    lo: int
    start: int
    end: int
    hi: int


class ChunkPlan:
    """Which codes to decode next: ``chunk`` codes at a time, each once ``future`` codes
    after it have come (or the utterance has ended), with ``past`` codes before it."""

    def __init__(self, chunk: int, past: int, future: int) -> None:
        self.chunk, self.past, self.future = chunk, past, future
        self.done = 0  # codes whose audio has been made

    def next(self, available: int, ended: bool) -> Window | None:
        if self.done >= available:
            return None
        end = min(self.done + self.chunk, available)
        if not ended and (end - self.done < self.chunk or available < end + self.future):
            return None
        window = Window(
            max(0, self.done - self.past), self.done, end, min(available, end + self.future)
        )
        self.done = end
        return window


def noise(seed: int, frames: int, mel_dim: int) -> Any:
    """The starting noise of every frame, as ``torch.manual_seed(seed)`` then the DiT's
    own ``torch.randn`` draws it for an utterance of ``frames`` frames (a longer draw
    begins with a shorter one when ``frames * mel_dim`` is a multiple of 16, which it is
    for mel_dim 80 and 16)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn([1, frames, mel_dim], generator=generator)


def sample(
    dit: Any,
    conditioning: Any,
    reference_mel: Any,
    code: Any,
    start_noise: Any,
    num_steps: int,
    guidance_scale: float,
    sway_coefficient: float,
) -> Any:
    """The mel (batch, mel_dim, frames) the DiT draws for ``code`` from ``start_noise``."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    frames = code.shape[1] * dit.repeats
    conditioning = conditioning.unsqueeze(1).repeat(1, frames, 1)

    def ode_function(time_step: Any, hidden_states: Any) -> Any:
        if guidance_scale < 1e-5:
            return dit(
                hidden_states=hidden_states,
                speaker_embedding=conditioning,
                condition_vector=reference_mel,
                quantized_code=code,
                time_step=time_step,
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=False,
            )
        output = dit(
            hidden_states=hidden_states,
            quantized_code=code,
            speaker_embedding=conditioning,
            condition_vector=reference_mel,
            time_step=time_step,
            apply_cfg=True,
        )
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=code.device, dtype=conditioning.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    solver = RungeKutta4ODESolver(function=ode_function, initial_value=start_noise)
    return solver.integrate(times)[-1].permute(0, 2, 1)


def vocode_span(vocoder: Any, mel: Any, first: int, last: int, context: int) -> Any:
    """The samples of mel frames ``[first, last)`` of ``mel`` (batch, mel_dim, frames),
    vocoded with ``context`` frames on each side where ``mel`` has them."""
    lo, hi = max(0, first - context), min(mel.shape[2], last + context)
    wav = vocoder(mel[:, :, lo:hi]).reshape(-1)
    per_frame = wav.shape[0] // (hi - lo)
    return wav[(first - lo) * per_frame : (last - lo) * per_frame]
