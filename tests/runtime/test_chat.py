"""Chat rendering through the artifact's template and processor: tools, thinking, images into the vision tower."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from runtime_media import image_message, mp4_data_url, png_data_url

from glmquant.errors import MissingDependencyError, UsageError
from glmquant.runtime.chat import ChatFormat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def chat(artifacts) -> ChatFormat:
    return ChatFormat(artifacts["tr3"], has_vision=True)


def test_template_renders_tools_history_and_generation_prompt(chat):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = chat.render(messages, TOOLS)
    assert prompt.text.startswith("[gMASK]<sop>") and prompt.text.rstrip().endswith("<|assistant|>")
    assert '"name": "get_weather"' in prompt.text  # the tool schema, as the template writes it
    assert "<arg_key>city</arg_key><arg_value>Paris</arg_value>" in prompt.text  # JSON arguments became a mapping
    assert "<tool_response>sunny</tool_response>" in prompt.text
    assert prompt.inputs.input_ids.shape == (1, prompt.inputs.num_tokens) and not prompt.inputs.vision
    assert chat.decode(prompt.inputs.input_ids[0].tolist()) == prompt.text
    assert not prompt.starts_in_reasoning
    no_think = chat.render([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert no_think.text.endswith("<think></think>") and not no_think.starts_in_reasoning


def test_image_parts_reach_the_vision_tower(chat, tr3_f32):
    red, blue = (chat.render([image_message(png_data_url(c))]) for c in ((255, 0, 0), (0, 0, 255)))
    text_only = chat.render([{"role": "user", "content": "What colour is this?"}])
    vision = red.inputs.vision
    assert set(vision) == {"pixel_values", "image_grid_thw"} and vision["image_grid_thw"].tolist() == [[1, 4, 4]]
    image_id = tr3_f32.model.config.image_token_id
    assert int((red.inputs.input_ids == image_id).sum()) == 4  # 4x4 patches merged 2x2
    assert red.inputs.num_tokens == text_only.inputs.num_tokens + 4 + 2  # placeholders + begin/end of image
    with torch.no_grad():
        logits = [tr3_f32.model(input_ids=p.inputs.input_ids, **p.inputs.vision).logits[0, -1] for p in (red, blue)]
    assert (logits[0] - logits[1]).abs().max() > 1e-4  # the pixels changed the answer's logits


def test_images_work_where_the_auto_class_wants_torchvision(artifacts, tr3_f32, monkeypatch):
    """transformers before 5.2x puts a torchvision-only object in AutoImageProcessor's place: without torchvision
    the model's PIL image processor is loaded instead, and an image still reaches the vision tower."""
    import transformers

    class NeedsTorchvision:  # what transformers 5.17 puts in the auto class's place without torchvision
        @staticmethod
        def from_pretrained(*_args, **_kwargs):
            raise ImportError("AutoImageProcessor requires the Torchvision library")

    monkeypatch.setattr(transformers, "AutoImageProcessor", NeedsTorchvision)
    fallback = ChatFormat(artifacts["tr3"], has_vision=True)
    assert type(fallback.processor.image_processor).__name__ == "Glm5NextImageProcessorPil"
    red = fallback.render([image_message(png_data_url((255, 0, 0)))])
    assert red.inputs.vision["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert red.inputs.vision["pixel_values"].shape[0] == 16 and red.inputs.vision["pixel_values"].std() > 0
    assert int((red.inputs.input_ids == tr3_f32.model.config.image_token_id).sum()) == 4


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "could not be decoded"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "only base64 data: URLs"),
        ({"type": "audio", "audio": {}}, "unsupported content part"),
    ],
)
def test_bad_content_is_a_usage_error(chat, part, message):
    with pytest.raises(UsageError, match=message):
        chat.render([{"role": "user", "content": [part]}])


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present: video works")
def test_video_without_torchvision_is_refused_clearly(chat):
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(MissingDependencyError, match=r"torchvision: install it on the server \(pip install"):
        chat.render([{"role": "user", "content": [video, {"type": "text", "text": "direction?"}]}])


def test_video_parts_reach_the_vision_tower(chat, tr3_f32):
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    pytest.importorskip("cv2", reason="the test writes its MP4 with OpenCV")
    video = {"type": "video_url", "video_url": {"url": mp4_data_url()}}
    prompt = chat.render([{"role": "user", "content": [video, {"type": "text", "text": "Which way does it move?"}]}])
    vision = prompt.inputs.vision
    assert {"pixel_values_videos", "video_grid_thw"} <= set(vision) and vision["video_grid_thw"][0, 0] >= 1
    assert int((prompt.inputs.input_ids == tr3_f32.model.config.video_start_token_id).sum()) == 1
    with torch.no_grad():
        logits = tr3_f32.model(input_ids=prompt.inputs.input_ids, **vision).logits
    assert torch.isfinite(logits).all()


def test_text_only_model_refuses_images(artifacts):
    text_only = ChatFormat(artifacts["tr3"], has_vision=False)
    with pytest.raises(UsageError, match="no vision tower"):
        text_only.render([image_message(png_data_url((0, 255, 0)))])
