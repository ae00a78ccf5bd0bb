"""The ``omni-thinker`` engine: Qwen2.5-Omni's thinker (transformers'
``Qwen2_5OmniThinkerForConditionalGeneration``). Chat or text in, with the last user
message's audio, images and videos (audio_in.py, vision_in.py, video_in.py; a video's
own audio track is heard only where the prompt asks, ``use_audio_in_video``:
video_audio.py); out, streamed as made:

- the answer's text, token by token (TEXT chunks, for the client);
- the tensors the talker reads (TENSOR chunks, ``TensorMeta``), as
  ``Qwen2_5OmniForConditionalGeneration.generate`` builds them from the thinker's hidden
  states: ``prompt_ids`` (int64, the prompt's token ids), ``prompt`` (the prompt's
  positions: last hidden state + input embedding, with the embeddings of audio, image and
  video positions zeroed), with a spoken input or heard tracks ``audio_feature_lengths``,
  with images ``image_grid_thw``, with videos ``video_grid_thw`` and
  ``video_second_per_grid``, with heard tracks ``use_audio_in_video`` (the talker's
  positions need them), ``first_token`` (int64, the
  answer's first token id), then one ``reply`` per answer token fed back in (last hidden
  state + embedding, shape (1, H)).
  The answer's last token is never fed back, so it has no ``reply``, as in transformers.

The thinker runs transformers' own ``generate`` (greedy when the request's temperature is
0); a forward hook reads each step's hidden states and a streamer each new token, so the
tokens and tensors are exactly the monolithic model's. A replica takes many requests but
generates for one at a time, in order (one worker thread): the model keeps per-request
state (its rope deltas) between steps. Batching them is still to come.

The model's window (``max_position_embeddings``) bounds prompt and answer together, as
the ``llm`` engine's does: a longer prompt is refused (``context_length_exceeded``) or,
with ``truncation: "auto"``, loses its oldest exchanges (``engines/llm/truncation.py``);
the answer stops at the window's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omnistage.config.omni_args import OmniThinkerArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.llm.truncation import context_length_error, truncate_prompt
from omnistage.engines.omni import audio_in, video_audio, video_in, vision_in
from omnistage.engines.omni.audio_in import AudioInput
from omnistage.engines.omni.checkpoint import (
    ThreadRun,
    TokenStreamer,
    checkpoint_dir,
    device_of,
    load_omni,
    placement,
    stop_criteria,
    tensor_chunk,
)
from omnistage.engines.omni.video_audio import Soundtracks
from omnistage.engines.omni.video_in import VideoInput
from omnistage.engines.omni.vision_in import ImageInput
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import Prompt, Usage
from omnistage.protocol.params import GenerationParams, StageParams


@dataclass
class Media:
    """A prompt's spoken input, images and videos, and the videos' own audio tracks
    where the prompt asks to hear them, as prepared for the thinker (None: none)."""

    heard: AudioInput | None = None
    seen: ImageInput | None = None
    watched: VideoInput | None = None
    sound: Soundtracks | None = None

    def placeholder(self) -> str:
        """Their placeholders, in this order, before the last user message's text (each
        video's tokens interleaved with its track's, where heard)."""
        out = "".join(m.placeholder() for m in (self.heard, self.seen) if m)
        if self.watched is not None and self.sound is not None:
            return out + self.sound.placeholder(self.watched)
        return out + (self.watched.placeholder() if self.watched is not None else "")

    def _audio(self) -> list[AudioInput]:
        """Every audio the prompt holds, in prompt order: the spoken input, the tracks."""
        return ([self.heard] if self.heard else []) + (self.sound.tracks if self.sound else [])

    def _features(self) -> tuple[Any, Any] | None:
        """Every audio's features and masks, one row each. Qwen3-Omni's are as long as
        each audio: the shorter are padded (the masks say what is read)."""
        import torch
        import torch.nn.functional as F

        audio = self._audio()
        if not audio:
            return None
        frames = max(a.mask.shape[-1] for a in audio)
        features = [F.pad(a.features, (0, frames - a.features.shape[-1])) for a in audio]
        masks = [F.pad(a.mask, (0, frames - a.mask.shape[-1])) for a in audio]
        return torch.cat(features), torch.cat(masks)

    def inputs(self, device: Any) -> dict[str, Any]:
        """The thinker's inputs for them, as the processor names them."""
        out = {}
        if (heard := self._features()) is not None:
            out["input_features"] = heard[0].to(device)
            out["feature_attention_mask"] = heard[1].to(device)
        if self.seen is not None:
            out["pixel_values"] = self.seen.pixels.to(device)
            out["image_grid_thw"] = self.seen.grid.to(device)
        if self.watched is not None:
            out["pixel_values_videos"] = self.watched.pixels.to(device)
            out["video_grid_thw"] = self.watched.grid.to(device)
            out["video_second_per_grid"] = self.watched.seconds.to(device)
        return out

    def sizes(self) -> list[EngineChunk]:
        """What the talker's positions (its rope) depend on, as the thinker's do: the
        spoken input's and the heard tracks' lengths in frames, the images' and videos'
        patch grids, the seconds a video's temporal patch spans, and whether the tracks
        are heard (their tokens then sit inside the videos')."""
        out = []
        if (heard := self._features()) is not None:
            out.append(tensor_chunk("audio_feature_lengths", heard[1].sum(-1)))
        if self.seen is not None:
            out.append(tensor_chunk("image_grid_thw", self.seen.grid))
        if self.watched is not None:
            out.append(tensor_chunk("video_grid_thw", self.watched.grid))
            out.append(tensor_chunk("video_second_per_grid", self.watched.seconds))
        if self.sound is not None:
            out.append(tensor_chunk("use_audio_in_video", _long([1])))
        return out


_REPLACEMENT = "\ufffd"


class OmniThinkerEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = OmniThinkerArgs.model_validate(stage.engine_args)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-thinker")
        self.thinker: Any = None
        self.tokenizer: Any = None
        self.extractor: Any = None
        self.image_processor: Any = None
        self.window = 0  # the model's context (positions), once loaded

    async def start(self) -> None:
        self.starting = f"loading the thinker of {self.args.model}"
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self.starting = ""

    def _load(self) -> None:
        from transformers import AutoTokenizer

        directory = checkpoint_dir(self.args)
        model = load_omni(self.args, directory)
        model.disable_talker()  # the talker and token2wav run in their own stages
        self.thinker = model.thinker.to(device_of(self.args))
        self.kernel = placement(self.thinker)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.extractor = audio_in.load_extractor(directory)
        self.image_processor = vision_in.load_processor(directory)
        self.window = self.thinker.config.text_config.max_position_embeddings
        self.video_settings = video_in.VideoSettings.of(self.image_processor, self.window)
        self._configure(model)

    def _configure(self, model: Any) -> None:
        """What the talker's tensors are made with, read from the whole model."""
        special = self.thinker.config
        # Positions whose embedding the talker does not see (transformers zeroes them).
        self._media_ids = (
            special.audio_token_index,
            special.image_token_index,
            special.video_token_index,
        )

    def check(self, params: StageParams) -> None:
        asked = params.generation
        for field, value in (
            ("tools", asked.tools),
            ("logprobs", asked.logprobs),
            ("stop", asked.stop),
        ):
            if value:
                raise BadRequestError(f"{field} is not supported by the omni thinker yet", field)
        kind = (asked.response_format or {}).get("type", "text")
        if kind != "text":
            raise BadRequestError(
                "response_format other than text is not supported by the omni thinker yet",
                "response_format",
            )

    def prompt_ids(self, prompt: Prompt | None, given: Media | None = None) -> list[int]:
        """The token ids of a chat (through the checkpoint's chat template) or a text; the
        placeholders of the spoken input, then of the images, then of the videos, go
        before the last user message's text."""
        if prompt is not None and prompt.messages:
            messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
            media = given.placeholder() if given is not None else ""
            if media:
                last = max(i for i, m in enumerate(messages) if m["role"] == "user")
                asked = messages[last]
                messages[last] = {**asked, "content": media + asked["content"]}
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        text = prompt.text if prompt is not None and prompt.text is not None else ""
        return list(self.tokenizer(text)["input_ids"])

    def fitted_ids(
        self, prompt: Prompt | None, given: Media, params: GenerationParams, answer: int
    ) -> list[int]:
        """The prompt's ids within the model's window: with ``truncation: "auto"`` (a
        Realtime session's, a response's when asked) the oldest exchanges go first; a
        prompt that still leaves no room for one new token is refused, as the llm
        engine refuses it. The media's placeholders count: they are positions too."""
        if params.truncation == "auto" and prompt is not None:
            prompt, _ = truncate_prompt(
                prompt, lambda trial: len(self.prompt_ids(trial, given)), self.window, answer
            )
        ids = self.prompt_ids(prompt, given)
        if len(ids) >= self.window:
            raise context_length_error(self.window, len(ids))
        return ids

    def hear(self, prompt: Prompt) -> AudioInput:
        """The prompt's spoken input, prepared as the model's processor prepares it."""
        return audio_in.prepare(self.extractor, audio_in.samples(prompt))

    def see(self, images: list[bytes]) -> ImageInput:
        """The prompt's images, prepared as the model's processor prepares them."""
        return vision_in.prepare(self.image_processor, images)

    def watch(self, videos: list[bytes]) -> VideoInput:
        """The prompt's videos, prepared as the model's processor prepares them."""
        return video_in.prepare(self.video_settings, videos)

    def listen_to(self, videos: list[bytes]) -> Soundtracks:
        """The videos' own audio tracks, prepared as the model's processor prepares them."""
        config, most = self.thinker.config, self.video_settings.most_tokens
        return video_audio.prepare(self.extractor, videos, config, most)

    def media(self, prompt: Prompt | None) -> Media:
        if prompt is None:
            return Media()
        videos = prompt.videos
        return Media(
            self.hear(prompt) if prompt.audio is not None else None,
            self.see(prompt.images) if prompt.images else None,
            self.watch(videos) if videos else None,
            self.listen_to(videos) if videos and prompt.audio_in_video else None,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        prompt = request.prompt
        given = self.media(prompt)
        params = request.params.generation
        max_new = params.max_tokens or self.args.default_max_tokens
        ids = self.fitted_ids(prompt, given, params, max_new)
        # Past the window the rope positions are ones the model never saw: stop there.
        max_new = min(max_new, self.window - len(ids))
        run = ThreadRun(asyncio.get_running_loop())
        text = AnswerText(self.tokenizer)
        tokens: list[int] = []

        def work(run: ThreadRun) -> None:
            self._generate(ids, given, params, max_new, run)

        async for kind, value in run.events(self._executor, work):
            self.progress += 1
            if kind == "states":
                yield value
            else:
                tokens.append(value)
                if len(tokens) == 1:
                    yield tensor_chunk("first_token", _long([value]))
                piece = text.add(tokens)
                if piece:
                    yield EngineChunk(Modality.TEXT, text=piece)
        eos = self.thinker.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        stopped = bool(tokens) and tokens[-1] in eos_ids
        yield EngineChunk(
            Modality.TEXT,
            text=text.finish(tokens),
            finished=True,
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            usage=Usage(len(ids), len(tokens)),
        )

    def _generate(
        self,
        ids: list[int],
        given: Media,
        params: GenerationParams,
        max_new: int,
        run: ThreadRun,
    ) -> None:
        import torch

        device = self.thinker.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)

        steps = [0]

        def on_forward(module: Any, args: Any, output: Any) -> None:
            steps[0] += 1
            for chunk in self._states(output.hidden_states, steps[0] == 1, input_ids, given):
                run.emit(("states", chunk))

        sampling: dict[str, Any] = {"do_sample": False, **given.inputs(device)}
        if params.temperature:
            sampling.update(do_sample=True, temperature=params.temperature)
            if params.top_p is not None:
                sampling["top_p"] = params.top_p
            if params.top_k is not None and params.top_k > 0:
                sampling["top_k"] = params.top_k
        hook = self.thinker.register_forward_hook(on_forward)
        try:
            with torch.no_grad():
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                self.thinker.generate(
                    input_ids=input_ids,
                    max_new_tokens=max_new,
                    use_audio_in_video=given.sound is not None,
                    output_hidden_states=True,
                    return_dict_in_generate=True,
                    streamer=TokenStreamer(lambda token: run.emit(("token", token))),
                    stopping_criteria=stop_criteria(run),
                    **sampling,
                )
        finally:
            hook.remove()

    def _media(self, input_ids: Any) -> Any:
        """Which prompt positions hold audio, image or video (a bool per position)."""
        import torch

        return torch.isin(input_ids[0], torch.tensor(self._media_ids, device=input_ids.device))

    def _states(self, hidden: Any, prompt: bool, input_ids: Any, given: Media) -> list[EngineChunk]:
        """The talker's tensors from one forward step's hidden states (one tuple entry per
        layer, the input embedding first): the prompt's on the first step, else a reply.
        The sizes of the prompt's media too: the talker's positions depend on them."""
        embeds, last = hidden[0][0], hidden[-1][0]
        if not prompt:
            return [tensor_chunk("reply", last + embeds)]
        out = given.sizes()
        embeds = embeds.masked_fill(self._media(input_ids).unsqueeze(-1), 0.0)
        out.append(tensor_chunk("prompt_ids", input_ids[0]))
        out.append(tensor_chunk("prompt", last + embeds))
        return out

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _long(values: list[int]) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.long)


class AnswerText:
    """The answer's text as tokens come, as pieces that join to the decode of all the
    tokens (``finish``).

    Decoding the tokens so far need not extend the previous decode: a partial UTF-8
    character decodes as U+FFFD until its last byte comes, and a tokenizer may rewrite
    the end of its text once the next token is there (``clean_up_tokenization_spaces``
    turns "a ." into "a."; a merge). As incremental detokenizers do (vLLM's), only
    what is stable goes out: the longest prefix that the last two decodes agree on,
    less a trailing partial character; the rest is held until a later token settles it,
    or the end."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._sent = ""
        self._last = ""  # the previous decode

    def _decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def add(self, tokens: list[int]) -> str:
        """The next piece, once ``tokens`` (all so far) are decoded; may be empty."""
        full = self._decode(tokens)
        stable = _common_prefix(self._last, full).rstrip(_REPLACEMENT)
        self._last = full
        if len(stable) <= len(self._sent) or not stable.startswith(self._sent):
            return ""
        piece, self._sent = stable[len(self._sent) :], stable
        return piece

    def finish(self, tokens: list[int]) -> str:
        """The rest: what the decode of all the tokens has after the pieces sent (should
        a tokenizer have rewritten text already sent, what follows the part they share)."""
        full = self._decode(tokens)
        return full[len(_common_prefix(self._sent, full)) :]


def _common_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return a[:i]
    return a[:n]
