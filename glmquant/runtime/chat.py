"""OpenAI chat messages -> model inputs, through the artifact's own chat template and processor.

Text goes through the tokenizer's chat template (with `tools` and template kwargs such as
`enable_thinking`). Image and video parts (data: URLs only: the server fetches nothing) are decoded and
handed to transformers' `Glm5NextProcessor`, which expands each `<|image|>` / `<|video|>` placeholder to
the vision tower's token count and produces pixel_values / *_grid_thw for the prefill forward.
transformers' video processor needs torchvision (`pip install 'glmquant[video]'`), and decoding a video needs
PyAV (a dependency) or OpenCV; where they are missing, video parts are refused with MissingDependencyError (the
server answers 501: its gap, not the request's) and images still work.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import io
import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmquant.errors import MissingDependencyError, UsageError
from glmquant.glm_tags import OUTPUT_MARKUP
from glmquant.runtime.generate import PromptInputs
from glmquant.runtime.glm_output import THINK_CLOSE, THINK_OPEN

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
VIDEO_DECODERS = (("pyav", "av"), ("opencv", "cv2"), ("decord", "decord"), ("torchcodec", "torchcodec"))


@dataclass
class Media:
    """The data: URLs of one request's images and videos, in placeholder order (decoded only once needed)."""

    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    inputs: PromptInputs

    @property
    def starts_in_reasoning(self) -> bool:
        """The template opened `<think>` for the model (its output begins inside the reasoning)."""
        return self.text.rfind(THINK_OPEN) > self.text.rfind(THINK_CLOSE)


class ChatFormat:
    """The artifact's tokenizer, chat template and (for models with a vision tower) processor."""

    def __init__(self, path: str | Path, has_vision: bool) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path))  # the class the checkpoint names
        if not self.tokenizer.chat_template:
            raise UsageError(
                f"{path}: the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        self.processor = _load_processor(Path(path), self.tokenizer) if has_vision else None
        self._special_ids = frozenset(self.tokenizer.all_special_ids)
        markup = {self.tokenizer.convert_tokens_to_ids(tag) for tag in OUTPUT_MARKUP}
        self._special_ids_but_markup = self._special_ids - markup
        # no token stands for more UTF-8 bytes of text than its vocabulary entry has (byte-level and
        # SentencePiece entries spell one byte with up to 3): bytes / this bounds the tokens from below
        self.max_token_bytes = max(len(token.encode()) for token in self.tokenizer.get_vocab())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, keep_markup: bool = False) -> str:
        """Token ids -> text. `skip_special_tokens` drops special tokens (vLLM's option of that name), except,
        with `keep_markup`, GLM's output markup (`<think>`, `<tool_call>`...) that the output parser reads."""
        if skip_special_tokens:
            hidden = self._special_ids_but_markup if keep_markup else self._special_ids
            ids = [i for i in ids if i not in hidden]
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Messages (OpenAI format) -> prompt text and model inputs; bad content raises UsageError."""
        media = Media()
        hf_messages = [_hf_message(m, media) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                hf_messages,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=True,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises many types on odd input (e.g. raise_exception in a template)
            raise UsageError(f"the chat template could not render these messages: {exc}") from None
        return RenderedPrompt(text, self._encode(text, media))

    def _encode(self, text: str, media: Media) -> PromptInputs:
        if not media.images and not media.videos:
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            return PromptInputs(ids)
        if self.processor is None:
            raise UsageError("this model has no vision tower: image and video content is not accepted")
        if media.videos and self.processor.video_processor is None:
            raise MissingDependencyError(
                "video input needs transformers' video processor, which needs torchvision: "
                "install it on the server (pip install 'glmquant[video]')"
            )
        images = [_decode_image(url) for url in media.images]
        decoded = [_decode_video(url) for url in media.videos]
        videos, metadata = [v for v, _ in decoded], [m for _, m in decoded]
        try:
            out = self.processor(
                text=[text],
                images=images or None,
                videos=videos or None,
                video_metadata=metadata or None,
                return_tensors="pt",
            )
        except Exception as exc:  # noqa: BLE001 - processors raise many types on odd media
            raise UsageError(f"could not process the image/video content: {exc}") from None
        return PromptInputs(out["input_ids"], {k: out[k] for k in VISION_KEYS if k in out})


def _load_processor(path: Path, tokenizer: Any) -> Any:
    """transformers' Glm5NextProcessor with the artifact's image (and, with torchvision, video) processor."""
    from transformers import AutoImageProcessor, Glm5NextProcessor

    try:
        from transformers import AutoVideoProcessor

        video = AutoVideoProcessor.from_pretrained(str(path))
    except (ImportError, OSError, ValueError):
        video = None

    class _Processor(Glm5NextProcessor):
        """The model's processor, allowed to run without a video processor (no torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    try:
        try:
            image = AutoImageProcessor.from_pretrained(str(path))
        except ImportError as needs:  # before 5.2x the auto class maps to torchvision's processor; PIL's needs Pillow
            try:
                from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
            except ImportError:
                raise MissingDependencyError(f"{path}: no image processor loads here ({needs})") from None
            image = Glm5NextImageProcessorPil.from_pretrained(str(path))
    except OSError as exc:
        raise UsageError(f"{path}: the model has a vision tower but no image processor config ({exc})") from None
    return _Processor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=tokenizer.chat_template
    )


def _hf_message(message: Mapping[str, Any], media: Media) -> dict[str, Any]:
    """One OpenAI message -> the form HF chat templates take (media collected into `media`)."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = [_hf_part(part, media) for part in content]
    if message.get("tool_calls"):
        out["tool_calls"] = [_hf_tool_call(tc) for tc in message["tool_calls"]]
    return out


def _hf_part(part: Mapping[str, Any], media: Media) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "image_url":
        media.images.append(_url(part, "image_url"))
        return {"type": "image"}
    if kind == "video_url":
        media.videos.append(_url(part, "video_url"))
        return {"type": "video"}
    raise UsageError(f"unsupported content part type {kind!r} (text, image_url, video_url)")


def _hf_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """Assistant tool calls carry JSON-text arguments in OpenAI's format; templates want a mapping."""
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"] or "{}")
        except json.JSONDecodeError:
            raise UsageError(f"tool call {function.get('name')!r} has arguments that are not JSON") from None
    return {**call, "function": function}


def _url(part: Mapping[str, Any], key: str) -> str:
    value = part.get(key)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str):
        raise UsageError(f"{key} part needs {{'{key}': {{'url': 'data:...'}}}}")
    return url


def _data_url_bytes(url: str) -> bytes:
    if not url.startswith("data:") or ";base64," not in url:
        raise UsageError("only base64 data: URLs are accepted for images and videos (the server fetches nothing)")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise UsageError("the data: URL is not valid base64") from None


def _decode_image(url: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(_data_url_bytes(url)))
        image.load()
    except UnidentifiedImageError:  # its message shows the in-memory file's repr, not the reason
        raise UsageError(
            "the image data could not be decoded: it is in no format Pillow reads (PNG, JPEG, WebP, GIF, ...)"
        ) from None
    except (OSError, Image.DecompressionBombError) as exc:
        raise UsageError(f"the image data could not be decoded ({exc})") from None
    return image.convert("RGB")


def _decode_video(url: str) -> tuple[Any, Any]:
    """All frames (uint8 [T, H, W, 3]) and their metadata, by transformers' `load_video` with the first
    decoder installed (PyAV, OpenCV, decord or torchcodec); the processor samples frames by fps."""
    from transformers.video_utils import load_video

    backend = next((name for name, module in VIDEO_DECODERS if importlib.util.find_spec(module)), None)
    if backend is None:
        raise MissingDependencyError(
            "video input needs a video decoder: install av (PyAV) or opencv-python-headless on the server"
        )
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(_data_url_bytes(url))
        f.flush()
        try:
            # transformers annotates load_video narrower than it is: it takes a path, returns (frames, metadata)
            return load_video(f.name, backend=backend)  # type: ignore[arg-type, return-value]
        except Exception as exc:  # noqa: BLE001 - decoders raise many types on bad data
            raise UsageError(f"the video data could not be decoded ({exc})") from None
