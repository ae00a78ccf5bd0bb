"""The Qwen2.5-Omni talker's decode steps after its first code, without ``generate``'s
per-step machinery.

Around each forward, transformers' ``generate`` rebuilds the model's inputs
(``prepare_inputs_for_generation``), merges the outputs back into its kwargs and checks
its stopping criteria. On the tiny benchmark checkpoint (96 codes an answer, one
process, 12 alternating rounds, pairwise medians) the engine's decode took 0.91 of the
CPU it took through ``generate``'s loop, and 0.93 of the monolithic model's talker call.
The forward and the scores stay transformers': ``generate`` is called as before, with
the whole ``max_new_tokens`` (so its logits processors are the ones the whole call would
use), and stopped after the first code (``first_code``); ``PrefillCapture`` keeps what
it prepared: its logits processors and the prompt step's model inputs (the cache it
filled, and the attention mask it inferred, which masks the codec pad under the prompt).
Each later step calls the talker's forward with the inputs ``generate`` gives it (as
captured from ``generate``'s own decode steps: the last code, the cache, the mask one
longer, the text ids, the thinker's reply for the step, ``position_ids`` None so that the
talker continues its rope positions), scores the logits with those processors over the
whole code sequence (the repetition penalty reads it), and picks the code as
``generate``'s sampling loop does (``argmax``, or ``multinomial`` over the softmax: the
same draws from the same generator). So the codes are ``generate``'s, greedy and sampled alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import EngineError


class PrefillCapture:
    """While ``generate`` makes the first code: its logits processors
    (``_get_logits_processor``'s result) and the kwargs of the talker's prompt step (a
    forward pre-hook), and how many forwards it ran (one: ``decode_rest`` continues from
    the state that leaves). One request at a time per talker."""

    def __init__(self, talker: Any) -> None:
        self._talker = talker
        self.processors: Any = None
        self.kwargs: dict[str, Any] = {}
        self.forwards = 0
        self._hook: Any = None

    def __enter__(self) -> PrefillCapture:
        talker, build = self._talker, self._talker._get_logits_processor

        def record(*args: Any, **kwargs: Any) -> Any:
            self.processors = build(*args, **kwargs)
            return self.processors

        def prompt_step(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            self.forwards += 1
            if not self.kwargs:
                self.kwargs = dict(kwargs)

        talker._get_logits_processor = record  # the instance's, for this call only
        self._hook = talker.register_forward_pre_hook(prompt_step, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        del self._talker._get_logits_processor


def first_code() -> Any:
    """A stopping criterion that ends ``generate`` once it has made one code."""
    import torch
    from transformers import StoppingCriteria

    class FirstCode(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.ones((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)

    return FirstCode()


@dataclass
class Sampling:
    """How the next code is picked, and when decoding ends."""

    do_sample: bool
    eos: frozenset[int]
    max_new_tokens: int


def decode_rest(
    talker: Any,
    capture: PrefillCapture,
    codes: Any,
    sampling: Sampling,
    reply: Callable[[int], Any],
    on_code: Callable[[int], None],
    stopped: Callable[[], bool],
) -> None:
    """Continue after ``generate``'s first code: ``codes`` (1, prompt + 1) is the codec
    prompt and that code. Decode step ``n`` (1, 2, ...) adds ``reply(n)`` (1, 1, width)
    to its input, as the talker's ``thinker_reply_part`` does. Each new code goes to
    ``on_code`` until an end code, ``max_new_tokens`` codes in all, or ``stopped()``."""
    import torch

    if capture.forwards != 1:
        # generate stopped a step late (it may, on mps): the cache holds more than the
        # codes say. Not a state to continue from.
        raise EngineError(f"the talker's generate ran {capture.forwards} steps for one code")
    if capture.processors is None:
        # A transformers whose generate no longer builds them through
        # ``_get_logits_processor``: the scores could not be generate's.
        raise EngineError("the talker's generate built no logits processors we could keep")
    prompt = capture.kwargs
    mask = prompt.get("attention_mask")
    step = 0
    while codes.shape[1] - prompt_length(capture) < sampling.max_new_tokens and not stopped():
        step += 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        out = talker(
            input_ids=codes[:, -1:],
            cache=prompt["cache"],
            position_ids=None,
            attention_mask=mask,
            input_text_ids=prompt.get("input_text_ids"),
            thinker_reply_part=reply(step),
            use_cache=True,
            return_dict=True,
        )
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32, device=codes.device)
        scores = capture.processors(codes, logits)
        if sampling.do_sample:
            code = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            code = torch.argmax(scores, dim=-1)
        codes = torch.cat([codes, code[:, None]], dim=-1)
        value = int(code[0])
        if value in sampling.eos:
            return
        on_code(value)


def prompt_length(capture: PrefillCapture) -> int:
    """The codec prompt's length (the prompt step's embeddings)."""
    return int(capture.kwargs["inputs_embeds"].shape[1])
