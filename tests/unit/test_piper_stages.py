"""piper_stages without a voice: the soft limiter, and where a graph is cut."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.engines.speech.piper_stages import KNEE, limited, split


def test_the_limiter_leaves_quiet_audio_alone_and_bends_loud_audio_below_full_scale():
    quiet = np.linspace(-KNEE, KNEE, 101)
    assert np.array_equal(limited(quiet), quiet)
    loud = np.linspace(-1.6, 1.6, 3201)
    out = limited(loud)
    assert np.abs(out).max() < 1.0
    assert np.all(np.diff(out) > 0)  # still rising: louder stays louder
    # Continuous at the knee, with the same slope there.
    step = loud[1] - loud[0]
    at = np.searchsorted(loud, KNEE)
    assert abs(out[at] - loud[at]) < 1e-3
    assert abs((out[at + 1] - out[at]) / step - 1) < 0.01
    assert np.array_equal(limited(-loud), -out)  # the same both ways


def _graph(decoder_feeds: int) -> bytes:
    """A toy voice: ``input`` -> encoder Relu -> ``/dec/`` Tanh (fed once more by the
    input where ``decoder_feeds`` is 2) -> ``output``."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["input"], ["frames"], name="/enc_p/Relu")]
    if decoder_feeds == 2:
        nodes.append(helper.make_node("Add", ["frames", "input"], ["mixed"], name="/dec/Add"))
        nodes.append(helper.make_node("Tanh", ["mixed"], ["output"], name="/dec/Tanh"))
    else:
        nodes.append(helper.make_node("Tanh", ["frames"], ["output"], name="/dec/Tanh"))
    graph = helper.make_graph(
        nodes,
        "voice",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4])],
    )
    return onnx.helper.make_model(graph).SerializeToString()


def test_a_graph_is_cut_at_its_decoders_one_input_and_each_half_runs():
    ort = pytest.importorskip("onnxruntime")
    halves = split(_graph(1))
    assert halves is not None
    encoder, decoder, frames = halves
    assert frames == "frames"
    x = np.array([[-1.0, 0.5, 2.0, -3.0]], dtype=np.float32)
    made = ort.InferenceSession(encoder).run(None, {"input": x})[0]
    audio = ort.InferenceSession(decoder).run(None, {"frames": made})[0]
    assert np.allclose(audio, np.tanh(np.maximum(x, 0)))


def test_a_decoder_fed_by_more_than_the_frames_is_not_cut():
    assert split(_graph(2)) is None
