"""Where each patch of an image sits, for the vision graphs: the host computes it per
image (numpy) and hands it in as graph inputs, so one graph per vision bucket serves
every image shape (the Qwen2-VL family's and Qwen3-VL's towers, `vision`, and
Pixtral's, `pixtral`)."""

from __future__ import annotations

import numpy as np


def patch_inputs(
    grid_thw: np.ndarray, merge: int, patches: int, window: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(rotary_ids [patches, 2], groups [2, patches]) of an image of `grid_thw` padded to
    `patches`: each patch's (row, column) in merge-block order, as transformers'
    get_vision_position_ids lays them out, its frame and its window of `window` merge
    groups a side (get_vision_window_index's; 0: its frame), -1 for padding."""
    t, h, w = (int(n) for n in grid_thw)
    rows, cols = _block_order(h, w, merge)
    real = t * h * w
    rotary_ids = np.zeros((patches, 2), dtype=np.int64)
    rotary_ids[:real] = np.tile(np.stack([rows, cols], axis=-1), (t, 1))
    groups = np.full((2, patches), -1, dtype=np.int64)
    frames = np.repeat(np.arange(t), h * w)
    groups[0, :real] = frames
    if window:  # the window of each patch's merge group, numbered within the image
        across = -(-(w // merge) // window)  # windows a row
        down = -(-(h // merge) // window)
        row, col = rows // merge // window, cols // merge // window
        groups[1, :real] = (frames * down + np.tile(row, t)) * across + np.tile(col, t)
    else:
        groups[1, :real] = frames
    return rotary_ids, groups


def position_taps(
    grid_thw: np.ndarray, merge: int, side: int, patches: int
) -> tuple[np.ndarray, np.ndarray]:
    """(taps [patches, 4], weights [patches, 4]) of an image of `grid_thw` padded to
    `patches`: the rows of a `side` x `side` learned position grid each patch blends and
    their weights, bilinear with corners aligned, patches in merge-block order, as
    transformers' get_vision_interpolation_indices_and_weights computes them (float32);
    padding takes row 0 at weight 0."""
    t, h, w = (int(n) for n in grid_thw)
    rows, cols = _block_order(h, w, merge)
    taps = np.zeros((patches, 4), dtype=np.int64)
    weights = np.zeros((patches, 4), dtype=np.float32)
    (row_taps, row_weights), (col_taps, col_weights) = (
        _axis_taps(index, size, side) for index, size in ((rows, h), (cols, w))
    )
    # the 2-D taps: (row, column) pairs, row-major, and their weights' products
    frame_taps = row_taps[:, :, None] * side + col_taps[:, None, :]
    frame_weights = row_weights[:, :, None] * col_weights[:, None, :]
    real = t * h * w
    taps[:real] = np.tile(frame_taps.reshape(-1, 4), (t, 1))
    weights[:real] = np.tile(frame_weights.reshape(-1, 4), (t, 1))
    return taps, weights


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One axis's two taps into `side` rows and their weights for positions `index` of
    an axis `size` long (F.interpolate bilinear, align_corners=True)."""
    source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(source)
    fraction = source - floor
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    return taps, np.stack([np.float32(1) - fraction, fraction], axis=-1).astype(np.float32)


def _block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) of an h x w frame, in merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    return rows, cols
