"""A tiny dependency-free PNG writer (8-bit RGB) and a heatmap helper."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(rgb: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes (colour type 2, no filtering)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8 or min(rgb.shape[:2]) < 1:
        raise ValueError(f"image must be non-empty uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
    height, width = rgb.shape[:2]
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rgb.reshape(height, -1)], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + \
        _chunk(b"IEND", b"")


def write_png(path: str | Path, rgb: np.ndarray) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_png(rgb))
    return out


def colormap(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """float [H, W] -> uint8 [H, W, 3]: blue (vmin) -> white (midpoint) -> red (vmax)."""
    t = np.clip((values - vmin) / max(vmax - vmin, 1e-12), 0.0, 1.0)[..., None]
    blue, white, red = np.array([40, 70, 200.0]), np.array([255, 255, 255.0]), np.array([200, 30, 30.0])
    rgb = np.where(t < 0.5, blue + (white - blue) * (t * 2), white + (red - white) * (t * 2 - 1))
    return rgb.round().astype(np.uint8)


def heatmap_panels(panels: list[np.ndarray], vmin: float, vmax: float, cell: tuple[int, int] = (4, 8),
                   gap: int = 6) -> np.ndarray:
    """Side-by-side heatmaps of equally shaped [rows, cols] arrays, each cell ``cell`` (h, w) pixels."""
    if not panels or any(p.shape != panels[0].shape for p in panels):
        raise ValueError("panels must be a non-empty list of equally shaped 2-D arrays")
    images = [np.repeat(np.repeat(colormap(p, vmin, vmax), cell[0], axis=0), cell[1], axis=1) for p in panels]
    spacer = np.full((images[0].shape[0], gap, 3), 255, dtype=np.uint8)
    parts = [images[0]]
    for image in images[1:]:
        parts += [spacer, image]
    return np.concatenate(parts, axis=1)
