"""The omni stages' pure parts: a checkpoint picking its pipeline, the device and dtype a
stage loads in, the talker's feed of thinker tensors, voices, tensors as chunks, and the
thinker's text released token by token."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from omnistage.config.load import load_config
from omnistage.config.omni_args import OmniThinkerArgs, OmniToken2WavArgs
from omnistage.engines.omni.checkpoint import chunk_tensor, dtype_of, pick_voice, tensor_chunk
from omnistage.engines.omni.talker import ReplyFeed
from omnistage.engines.omni.thinker import AnswerText
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import BadRequestError, ConfigError


def _checkpoint(tmp_path: Path, model_type: str) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


def test_a_qwen2_5_omni_checkpoint_picks_thinker_talker_token2wav(tmp_path: Path) -> None:
    config = load_config(str(_checkpoint(tmp_path, "qwen2_5_omni")))
    assert [(s.name, s.engine, s.inputs) for s in config.stages] == [
        ("thinker", EngineName.OMNI_THINKER, ()),
        ("talker", EngineName.OMNI_TALKER, (0,)),
        ("token2wav", EngineName.OMNI_TOKEN2WAV, (1,)),
    ]
    assert {s.engine_args["model"] for s in config.stages} == {str(tmp_path.resolve())}
    assert [s.stage_id for s in config.stages if s.final_output] == [0, 2]


def test_a_qwen3_omni_checkpoint_picks_thinker_talker_code2wav(tmp_path: Path) -> None:
    config = load_config(str(_checkpoint(tmp_path, "qwen3_omni_moe")))
    assert [(s.name, s.engine, s.inputs) for s in config.stages] == [
        ("thinker", EngineName.OMNI3_THINKER, ()),
        ("talker", EngineName.OMNI3_TALKER, (0,)),
        ("code2wav", EngineName.OMNI3_CODE2WAV, (1,)),
    ]
    assert {s.engine_args["model"] for s in config.stages} == {str(tmp_path.resolve())}
    assert [s.stage_id for s in config.stages if s.final_output] == [0, 2]
    assert set(config.stage(0).reads_prompt) == {"text", "audio", "image", "video"}


def test_stage_overrides_apply_to_the_picked_pipeline(tmp_path: Path) -> None:
    overrides = {"1": {"replicas": 2, "engine_args": {"do_sample": False}}}
    config = load_config(str(_checkpoint(tmp_path, "qwen2_5_omni")), overrides)
    talker = config.stage(1)
    assert talker.replicas == 2
    assert talker.engine_args["do_sample"] is False
    assert talker.engine_args["model"] == str(tmp_path.resolve())


def test_an_unknown_engine_arg_of_an_omni_stage_is_refused_at_load(tmp_path: Path) -> None:
    overrides = {"2": {"engine_args": {"noise_sed": 1}}}
    with pytest.raises(ConfigError, match=r"stages\[2\]\.engine_args\.noise_sed"):
        load_config(str(_checkpoint(tmp_path, "qwen2_5_omni")), overrides)


def test_a_directory_of_another_model_type_is_refused_naming_the_known_ones(
    tmp_path: Path,
) -> None:
    known = "only for model_type qwen2_5_omni, qwen3_omni_moe; this one has model_type 'llama'"
    with pytest.raises(ConfigError, match=known):
        load_config(str(_checkpoint(tmp_path, "llama")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_config(str(empty))


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_the_cpu() -> None:
    def dtype(**args: str) -> str:
        return dtype_of(OmniThinkerArgs(model="m", **args))

    assert OmniThinkerArgs(model="m").dtype == "auto"
    assert dtype(device="cpu") == "float32"
    assert dtype(device="cuda") == "bfloat16"
    assert dtype(device="cuda:1") == "bfloat16"
    assert dtype(device="cuda", dtype="float32") == "float32"
    assert dtype(device="cpu", dtype="bfloat16") == "bfloat16"
    with pytest.raises(ValidationError):
        OmniToken2WavArgs(model="m", dtype="int8")


def test_a_bfloat16_tensor_crosses_as_a_chunk_unchanged() -> None:
    import torch

    tensor = torch.randn(3, 5).to(torch.bfloat16)
    chunk = tensor_chunk("reply", tensor)
    assert chunk.meta is not None and chunk.data is not None
    back = chunk_tensor(chunk.meta, chunk.data)
    assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)


def test_the_feed_gives_each_step_its_reply_then_text_end_then_pad() -> None:
    feed = ReplyFeed(threading.Event())
    for name in ("prompt_ids", "prompt", "first_token"):
        feed.put(name, name)
    for token in ("r0", "r1", "r2"):
        feed.put("reply", token)
    assert feed.start()
    feed.end()
    steps = [feed.reply(step, "eos", "pad") for step in range(1, 7)]
    assert steps == ["r1", "r2", "eos", "pad", "pad", "pad"]


def test_a_step_waits_for_its_reply() -> None:
    feed = ReplyFeed(threading.Event())
    feed.put("reply", "r0")
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(feed.reply(1, "eos", "pad")))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got
    feed.put("reply", "r1")
    reader.join(5)
    assert got == ["r1"]


def test_an_answer_of_one_token_gives_the_talker_nothing_to_speak() -> None:
    feed = ReplyFeed(threading.Event())
    for name in ("prompt_ids", "prompt", "first_token"):
        feed.put(name, name)
    feed.end()
    assert not feed.start()


def test_voices_match_any_case_and_default_to_chelsie() -> None:
    speakers = {"Ethan": 1, "Chelsie": 2}
    assert pick_voice(speakers, None) == "Chelsie"
    assert pick_voice(speakers, "default") == "Chelsie"
    assert pick_voice(speakers, "ethan") == "Ethan"
    assert pick_voice({"Ethan": 1}, "default") == "Ethan"
    assert pick_voice({"Chelsie": 2, "Ethan": 1}, None, "Ethan") == "Ethan"  # Qwen3-Omni
    with pytest.raises(BadRequestError, match="Ethan, Chelsie") as err:
        pick_voice(speakers, "alloy")
    assert err.value.param == "voice"


class _Bytes:
    """A byte-level tokenizer: token i is byte i; decoding replaces broken UTF-8."""

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def _streamed(tokenizer: object, tokens: list[int]) -> list[str]:
    """The pieces the thinker streams as ``tokens`` come, its last one included."""
    text, pieces = AnswerText(tokenizer), []
    for n in range(1, len(tokens) + 1):
        pieces.append(text.add(tokens[:n]))
    pieces.append(text.finish(tokens))
    return pieces


def test_text_pieces_join_to_the_whole_decode_and_never_split_a_character() -> None:
    pieces = _streamed(_Bytes(), list("hé €!".encode()))
    assert "".join(pieces) == "hé €!"
    assert all("\ufffd" not in piece for piece in pieces)
    assert len([p for p in pieces if p]) > 2  # streamed, not all at the end


def test_text_a_tokenizer_rewrites_once_the_next_token_comes_is_streamed_whole() -> None:
    # A WordPiece tokenizer that cleans up tokenization spaces, as BERT-style checkpoints
    # do: "it '" becomes "it's" once "s" comes, so decoding the tokens so far does not
    # extend the previous decode. Text stopped there, before: "yes, it '".
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "it", "'", "s", "here", ".", "are", "you", "?", "yes", ",", "i", "m"]
    model = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    model.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    tokens = tokenizer("yes , it ' s here . are you ? i ' m here .")["input_ids"]
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    assert whole == "yes, it's here. are you? i'm here."
    pieces = _streamed(tokenizer, tokens)
    assert "".join(pieces) == whole
    assert len([p for p in pieces if p]) > len(tokens) // 2  # streamed, not all at the end
