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
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


def mp4_data_url(frames: int = 8, size: int = 56) -> str:
    """A square moving left to right, written with OpenCV (the caller skips when cv2 is missing)."""
    import tempfile

    import cv2
    import numpy as np

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        writer = cv2.VideoWriter(f.name, cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (size, size))
        for i in range(frames):
            frame = np.zeros((size, size, 3), np.uint8)
            x = i * (size - 16) // (frames - 1)
            frame[20:36, x : x + 16] = (0, 0, 255)
            writer.write(frame)
        writer.release()
        return "data:video/mp4;base64," + base64.b64encode(open(f.name, "rb").read()).decode()
