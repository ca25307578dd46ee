"""Small request payloads shared by the chat and server tests."""

from __future__ import annotations

import base64
import io


def png_data_url(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What colour is this?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
