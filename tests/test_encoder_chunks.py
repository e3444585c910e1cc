"""The video encoders' ``iter_moments``: each family's chunks (Wan's stream, LTX's stream and
temporal windows, HunyuanVideo's temporal windows, MiniMax-H3's clips) concatenate to exactly
``moments`` (bitwise: ``moments`` is their concatenation), read their clip window by window
(no window wider than one unit, nothing held past its unit, the first chunk out before the
last frames are read), and LTX refuses the frame counts its reference cannot encode.

The families' tiny synthetic configs (``SYNTHETIC``, seeded with ``init_synthetic``), at two
latent cells a side."""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

from app.families.encoder import TensorClip, VAEEncoder
from app.families.hunyuan_video import encoder as hunyuan_video
from app.families.ltx import encoder as ltx
from app.families.minimax_h3 import encoder as minimax_h3
from app.families.wan import encoder as wan

FAMILIES: dict[str, ModuleType] = {
    "wan": wan,
    "ltx": ltx,
    "hunyuan_video": hunyuan_video,
    "minimax_h3": minimax_h3,
}
CONFIGS = [(family, name) for family, m in FAMILIES.items() for name in m.SYNTHETIC]
# (family, or one embedded config's name; frames, chunks, frames one unit reads at most, frames
# held between chunks) under the default schedule: 1 frame, one unit, several units, a count
# trimmed / padded / cut
SCHEDULES: list[tuple[str, int, int, int, int]] = [
    ("wan", 1, 1, 1, 0),
    ("wan", 17, 1, 17, 0),  # 1 + 16: one chunk
    ("wan", 41, 3, 17, 0),  # 17 + 16 + 8
    ("wan", 23, 2, 17, 0),  # trimmed to 21 = 17 + 4
    ("ltx", 1, 1, 1, 0),
    ("ltx2-tiny", 17, 1, 17, 0),  # 1 + 16 (4 latent frames x temporal scale 4): one pass
    ("ltx2-tiny", 41, 3, 17, 0),  # 17 + 16 + 8
    ("ltx-tiny", 33, 1, 33, 0),  # 1 + 32 (4 latent frames x temporal scale 8)
    ("ltx-tiny", 81, 3, 33, 0),  # 33 + 32 + 16
    ("hunyuan_video", 1, 1, 1, 0),
    ("hunyuan_video", 16, 1, 16, 0),  # one window
    ("hunyuan_video", 41, 4, 17, 5),  # 17-frame windows every 12 frames
    ("hunyuan_video", 30, 3, 17, 5),  # the last window short
    ("minimax_h3", 1, 1, 1, 0),
    ("minimax_h3", 5, 1, 5, 0),  # one clip, padded to 17
    ("minimax_h3", 17, 1, 17, 0),
    ("minimax_h3", 45, 3, 17, 0),  # 3 clips, the last padded; the drop cuts it
]


def named(key: str) -> list[tuple[str, str]]:
    """(family, name) of each embedded config a schedule's key names: a family's, or one."""
    return [(family, name) for family, name in CONFIGS if key in (family, name)]


@cache
def encoder(family: str, name: str) -> VAEEncoder:
    module = FAMILIES[family]
    enc = module.Encoder(module.SYNTHETIC[name]).eval()
    module.init_synthetic(enc, torch.Generator().manual_seed(0))
    return enc


def clip(enc: VAEEncoder, frames: int, batch: int = 1, cells: int = 2) -> Tensor:
    """A seeded clip of ``cells`` latent cells a side."""
    side = cells * enc.spatial_scale
    gen = torch.Generator().manual_seed(frames)
    return torch.rand((batch, 3, frames, side, side), generator=gen) * 2 - 1


class RecordingClip(TensorClip):
    """A clip that records each ``window`` and ``release`` (and the chunks the test takes,
    through ``note``), and refuses a window before released frames as an MP4 clip does."""

    def __init__(self, x: Tensor) -> None:
        super().__init__(x)
        self.events: list[tuple[str, int, int]] = []
        self.released = 0

    def window(self, start: int, stop: int) -> Tensor:
        assert start >= self.released, f"frames from {start} asked after release({self.released})"
        self.events.append(("window", start, min(stop, self.shape[2])))
        return super().window(start, stop)

    def release(self, before: int) -> None:
        self.events.append(("release", before, 0))
        self.released = max(self.released, before)

    def note(self, chunk: Tensor) -> None:
        self.events.append(("chunk", chunk.shape[2], 0))

    def windows(self) -> list[tuple[int, int]]:
        return [(a, b) for kind, a, b in self.events if kind == "window"]


def recorded(enc: VAEEncoder, x: Tensor, **options: Any) -> tuple[list[Tensor], RecordingClip]:
    """``iter_moments`` of ``x`` as a recording clip: its chunks, and the clip."""
    rec = RecordingClip(x)
    chunks = []
    for chunk in enc.iter_moments(rec, **options):
        rec.note(chunk)
        chunks.append(chunk)
    return chunks, rec


def held_between_chunks(rec: RecordingClip) -> int:
    """The most frames read and not yet released when a chunk is handed out."""
    read = released = most = 0
    for kind, a, b in rec.events:
        if kind == "window":
            read = max(read, b)
        elif kind == "release":
            released = max(released, a)
        else:
            most = max(most, read - released)
    return most


# --- (a) the chunks are the moments -------------------------------------------------------
@pytest.mark.parametrize("family,name", CONFIGS)
def test_chunks_concatenate_to_moments(family, name):
    """Every default schedule of ``SCHEDULES``, from a clip and from a tensor: bitwise."""
    enc = encoder(family, name)
    for key, frames, count, _, _ in SCHEDULES:
        if key not in (family, name):
            continue
        x = clip(enc, frames)
        whole = enc.moments(x)
        chunks, _ = recorded(enc, x)
        assert len(chunks) == count, f"{name} {frames} frames: {len(chunks)} chunks"
        assert torch.equal(torch.cat(chunks, 2), whole), f"{name} {frames} frames"
        assert torch.equal(torch.cat(list(enc.iter_moments(x)), 2), whole)
        assert whole.shape[2] == enc.latent_frames(frames)


@pytest.mark.parametrize("family,name", CONFIGS)
def test_image_is_one_4d_chunk(family, name):
    enc = encoder(family, name)
    x = clip(enc, 1, batch=2)[:, :, 0]
    chunks = list(enc.iter_moments(x))
    assert len(chunks) == 1 and chunks[0].ndim == 4
    assert torch.equal(chunks[0], enc.moments(x))
    assert torch.equal(chunks[0], enc.moments(x.unsqueeze(2))[:, :, 0])


WAN_TILES = {"tiled": True, "tile_sample_size": 32, "tile_sample_stride": 16}
LTX_TILES = {"tiled": True, "tile_sample_size": 64, "tile_sample_stride": 32}


@pytest.mark.parametrize(
    "key,options,frames,count,cells",
    [
        ("wan", {"chunk_frames": 4}, 13, 3, 2),  # 5 + 4 + 4
        ("wan", {"chunk_frames": 0}, 13, 1, 2),
        ("wan", WAN_TILES, 21, 1, 6),  # tiles: the whole clip
        ("ltx2-tiny", {"chunk_frames": 4}, 13, 3, 2),  # 5 + 4 + 4
        ("ltx-tiny", {"chunk_frames": 8}, 25, 3, 2),  # 9 + 8 + 8
        ("ltx", {"chunk_frames": 0}, 41, 1, 2),
        # 17-frame windows every 8 frames, in diffusers' temporal ratio (8 for these configs)
        ("ltx", {"framewise": True}, 41, 5, 2),
        ("ltx2-tiny", LTX_TILES, 21, 1, 6),
        ("ltx-tiny", LTX_TILES, 17, 1, 3),
        ("hunyuan_video", {"framewise": False}, 30, 1, 2),
        ("hunyuan_video", {"tile_sample_frames": 8, "tile_sample_frame_stride": 4}, 29, 7, 2),
        ("minimax_h3", {"tiled": False}, 35, 3, 2),
    ],
)
def test_chunks_with_options(key, options, frames, count, cells):
    """The options' schedules too (spatial tiles: one chunk, the whole clip)."""
    for family, name in named(key):
        enc = encoder(family, name)
        x = clip(enc, frames, cells=cells)
        chunks, _ = recorded(enc, x, **options)
        assert len(chunks) == count, f"{name} {options}: {len(chunks)} chunks"
        assert torch.equal(torch.cat(chunks, 2), enc.moments(x, **options))


@pytest.mark.parametrize("name", list(ltx.SYNTHETIC))
def test_ltx_stream_is_the_one_pass(name):
    """LTX's default stream against the reference's one pass (``chunk_frames=0``): the same
    arithmetic in another order, float32 rounding apart."""
    enc = encoder("ltx", name)
    x = clip(enc, 41)
    torch.testing.assert_close(enc.moments(x), enc.moments(x, chunk_frames=0), rtol=0, atol=2e-6)


# --- (b) window by window, (d) one chunk at a time ----------------------------------------
@pytest.mark.parametrize("key,frames,count,unit,held", SCHEDULES)
def test_windows_are_one_unit(key, frames, count, unit, held):
    """No window reads more than one unit's frames; every frame is read once (HunyuanVideo:
    its windows' overlap again); frames released as soon as no later unit needs them."""
    for family, name in named(key):
        enc = encoder(family, name)
        _, rec = recorded(enc, clip(enc, frames))
        widths = [b - a for a, b in rec.windows()]
        assert max(widths) <= unit, f"{name}: windows {rec.windows()}"
        assert held_between_chunks(rec) <= held, f"{name}: {rec.events}"
        if count > 1:
            assert max(widths) < frames  # never the whole clip
        if family != "hunyuan_video":
            assert sum(widths) <= frames  # nothing read twice


@pytest.mark.parametrize("key,frames,count,unit,held", [s for s in SCHEDULES if s[2] >= 3])
def test_first_chunk_before_last_frames(key, frames, count, unit, held):
    """A long clip: the first chunk comes out before the last frames are read, each chunk
    right after its own unit's window."""
    for family, name in named(key):
        enc = encoder(family, name)
        _, rec = recorded(enc, clip(enc, frames))
        kinds = [kind for kind, _, _ in rec.events]
        last = max(i for i, (kind, _, b) in enumerate(rec.events) if kind == "window")
        assert kinds.index("chunk") < last
        reads = [i for i, kind in enumerate(kinds) if kind == "window"]
        outs = [i for i, kind in enumerate(kinds) if kind == "chunk"]
        assert len(reads) == len(outs) and all(r < o for r, o in zip(reads, outs, strict=True))
        assert all(o < r for o, r in zip(outs, reads[1:], strict=False))


def test_wan_tiles_read_the_clip_once():
    enc = encoder("wan", "wan2.1-tiny")
    _, rec = recorded(enc, clip(enc, 11, cells=6), **WAN_TILES)
    assert rec.windows() == [(0, 9)]  # the 1 + 4k frames the reference reads


# --- (c) the LTX frame rule ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(ltx.SYNTHETIC))
def test_ltx_frame_rule(name):
    """Temporal scale 4 or 8 (space-to-depth downsamplers): 1 + 4k or 1 + 8k frames; others
    are refused with the rule, before any frame is read; the other families take any count."""
    enc = encoder("ltx", name)
    k = enc.temporal_scale
    for frames in (2, 8, 24):
        rule = f"1 \\+ {k}k frames \\(1, {1 + k}, {1 + 2 * k}, ...\\)"
        words = f"LTX encodes {rule}: {frames} frames is not one"
        assert enc.frames_problem(frames)
        with pytest.raises(ValueError, match=words):
            enc.moments(clip(enc, frames))
        rec = RecordingClip(clip(enc, frames))
        with pytest.raises(ValueError, match="trim the clip to"):
            next(enc.iter_moments(rec))
        assert rec.events == []
    assert f"trim the clip to {1 + 23 // k * k} frames" in enc.frames_problem(24)
    for frames in (1, 9, 17):
        assert enc.frames_problem(frames) == ""
        assert enc.moments(clip(enc, frames)).shape[2] == enc.latent_frames(frames)
    for family in ("wan", "hunyuan_video", "minimax_h3"):
        other = encoder(family, next(iter(FAMILIES[family].SYNTHETIC)))
        assert all(other.frames_problem(frames) == "" for frames in range(1, 26))


def test_ltx_rule_of_mixed_downsamplers():
    """A stride-2 conv takes any count, a space-to-depth one 1 + 2k: several residues."""
    enc = ltx.Encoder(
        {
            **ltx.SYNTHETIC["ltx-tiny"],
            "block_out_channels": [8, 16, 32, 32, 32],
            "spatio_temporal_scaling": [True] * 4,
            "layers_per_block": [1] * 5,
            "downsample_type": ["temporal", "spatial", "conv", "spatiotemporal"],
        }
    )
    assert enc.temporal_scale == 8
    fits = [t for t in range(1, 20) if not enc.frames_problem(t)]
    assert fits == [1, 3, 9, 11, 17, 19]
    assert enc.frames_problem(5).startswith("LTX encodes 1 + 8k or 3 + 8k frames (1, 3, 9, 11")


# --- the gate's probes ----------------------------------------------------------------------
@pytest.mark.parametrize("family,name", CONFIGS)
def test_probe_spans_two_chunks(family, name):
    """The parity gate compares the served chunks of ``probe_input``: at least two."""
    enc = encoder(family, name)
    probe = enc.probe_input(torch.Generator().manual_seed(0))
    assert len(list(enc.iter_moments(probe))) >= 2
