"""The ``omni3-thinker`` engine: Qwen3-Omni's thinker (transformers'
``Qwen3OmniMoeThinkerForConditionalGeneration``), run as the Qwen2.5-Omni thinker runs
(engines/omni/thinker.py: text streamed token by token, greedy or sampled, one request at
a time), the last user message's audio and images prepared as ``Qwen3OmniMoeProcessor``
prepares them (audio_in.py, vision_in.py, video_in.py: their placeholders are not
Qwen2.5-Omni's; a video's own audio track, where heard, merged with its frames by time:
video_audio.py), with
the tensors ``Qwen3OmniMoeForConditionalGeneration.generate`` hands its talker, streamed
as made (TENSOR chunks, ``TensorMeta``):

- with a spoken input ``audio_feature_lengths`` (int64, its feature frames), with images
  ``image_grid_thw`` (int64, their patch grids), with videos ``video_grid_thw`` and
  ``video_second_per_grid``: the talker's positions depend on them;
- ``prompt_ids`` (int64, the prompt's token ids) and ``prompt_embeds`` (the prompt's input
  embeddings), from the prompt's step;
- ``prompt_hidden`` (the hidden state of the talker's ``accept_hidden_layer`` at every
  prompt position), only when the prompt has audio, image or video positions: the talker
  reads it there and nowhere else;
- ``first_token`` (int64, the answer's first token id);
- one ``reply`` per answer token fed back in: its input embedding, shape (1, H). The
  answer's last token is never fed back, so it has no ``reply``, as in transformers.

The talker projects these itself (its ``text_projection`` and ``hidden_projection``), as
the monolithic model does after the thinker has finished.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnistage.engines.base import EngineChunk
from omnistage.engines.omni import audio_in, video_audio, video_in, vision_in
from omnistage.engines.omni.audio_in import AudioInput
from omnistage.engines.omni.checkpoint import tensor_chunk
from omnistage.engines.omni.thinker import Media, OmniThinkerEngine
from omnistage.engines.omni.video_audio import Soundtracks
from omnistage.engines.omni.video_in import VideoInput
from omnistage.engines.omni.vision_in import ImageInput
from omnistage.protocol.messages import Prompt


class Omni3ThinkerEngine(OmniThinkerEngine):
    def _configure(self, model: Any) -> None:
        special = self.thinker.config
        self._media_ids = (special.audio_token_id, special.image_token_id, special.video_token_id)
        self._accept_layer = model.config.talker_config.accept_hidden_layer
        # The processor's audio window, which must be the audio tower's.
        self._n_window = special.audio_config.n_window

    def hear(self, prompt: Prompt) -> AudioInput:
        return audio_in.prepare_qwen3(self.extractor, audio_in.samples(prompt), self._n_window)

    def see(self, images: list[bytes]) -> ImageInput:
        return dataclasses.replace(super().see(images), marks=vision_in.QWEN3_MARKS)

    def watch(self, videos: list[bytes]) -> VideoInput:
        return dataclasses.replace(super().watch(videos), marks=video_in.QWEN3_MARKS)

    def listen_to(self, videos: list[bytes]) -> Soundtracks:
        config, most = self.thinker.config, self.video_settings.most_tokens
        return video_audio.prepare_qwen3(self.extractor, videos, config, most)

    def _states(self, hidden: Any, prompt: bool, input_ids: Any, given: Media) -> list[EngineChunk]:
        embeds = hidden[0][0]
        if not prompt:
            return [tensor_chunk("reply", embeds)]
        out = given.sizes()
        out += [tensor_chunk("prompt_ids", input_ids[0]), tensor_chunk("prompt_embeds", embeds)]
        if bool(self._media(input_ids).any()):
            out.append(tensor_chunk("prompt_hidden", hidden[self._accept_layer][0]))
        return out
