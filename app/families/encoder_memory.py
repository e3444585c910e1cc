"""The encoders' working-memory model (``working_bytes``; docs/encoders.md, "Memory").

An encoder is a stack of levels: resnets of one width at one resolution, each level a
downsampling of the one before. The peak is that of one level's resnet, as the CPU runs it
(measured with every allocation of PyTorch's CPU allocator, oneDNN's included:
``tests/test_encoder_memory.py``):

- ``maps_per_frame`` maps of the level's width per frame (the block input, the norm and the
  activation, the conv's input and output, and oneDNN's blocked copies of those: a family's
  constant, measured), plus ``PAD_MAPS`` maps per frame a causal conv pads in front (in its
  padded copy of the input and in oneDNN's blocked copy of that);
- the widest conv's own temporary: oneDNN re-packs the weight on every call, or, where
  ``app.families.ops.conv3d`` sends a weight-heavy conv to im2col, the columns (one value per
  weight tap per input value). On a small input the deep levels' weights are the peak.

The estimate is the largest level's, plus what the family holds beyond one pass (outputs,
Wan's frame carries, copies of the input).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.families.ops import WEIGHT_HEAVY

# per padded frame: the padded copy's and oneDNN's copy's (measured, with a margin)
PAD_MAPS = 2.5
# oneDNN's copy of a conv weight (its channels padded to whole blocks), against the weight:
# measured, with a margin
REPACK = 1.25


@dataclass(frozen=True)
class Level:
    """One level's resnets: ``width`` channels, ``frames`` x ``pixels`` positions, convs of
    ``taps`` weights per channel pair padding ``pad_frames`` in front (a 2-D encoder: one
    frame, 9 taps, none padded)."""

    width: int
    frames: int
    pixels: int
    taps: int = 27
    pad_frames: int = 2


def conv_temporary(level: Level) -> int:
    """Values of the level's widest conv's own temporary: the re-packed weight, or the im2col
    columns where ``ops.conv3d`` takes that path (a weight above ``WEIGHT_HEAVY`` x input)."""
    weight = level.width**2 * level.taps
    x = level.width * (level.frames + level.pad_frames) * level.pixels
    return int(REPACK * weight) if weight <= WEIGHT_HEAVY * x else level.taps * x


def level_values(level: Level, maps_per_frame: float) -> int:
    """Values live at once in one of the level's resnets."""
    maps = maps_per_frame * level.frames + PAD_MAPS * level.pad_frames
    return int(maps * level.width * level.pixels) + conv_temporary(level)


def peak_values(levels: list[Level], maps_per_frame: float) -> int:
    """The largest level's values: the peak of one pass."""
    return max(level_values(level, maps_per_frame) for level in levels)
