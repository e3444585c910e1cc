"""The device-aware settings of issue 23.7/23.4: one table per family, read by device type.

Each setting has a CPU value and a GPU value (``cuda``); the CPU's decides what a CPU decode
does, and the GPU proof's ``video`` section measures the GPU candidates. These tests change a
table's CPU value and see the decode follow it, so a setting that is not read fails here.
"""

from __future__ import annotations

import torch

from app.families import families, keys
from app.families.ltx import decoder as ltx
from app.families.ltx.decoder import decode as ltx_decode
from app.families.minimax_h3 import decoder as minimax_h3
from app.families.minimax_h3.decoder import decode as mm_decode
from app.families.wan import decoder as wan
from app.families.wan.decoder import decode as wan_decode
from app.runtime import modes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _seeded(module, name: str):
    decoder = module.Decoder(module.SYNTHETIC[name])
    module.init_synthetic(decoder, torch.Generator().manual_seed(0))
    return decoder.eval()


def test_each_table_has_a_cpu_and_a_gpu_value_and_the_gpu_one_is_a_candidate():
    assert ltx_decode.chunk_frames_for(CPU) == ltx_decode.CHUNK_FRAMES["cpu"] == 2
    assert ltx_decode.chunk_frames_for(CUDA) in ltx_decode.GPU_CHUNK_CANDIDATES
    assert wan_decode.chunk_frames_for(CPU) == 2
    assert wan_decode.chunk_frames_for(CUDA) in wan_decode.GPU_CHUNK_CANDIDATES
    assert mm_decode.batch_tokens_for(CPU) == 16384
    assert mm_decode.batch_tokens_for(CUDA) in mm_decode.GPU_BATCH_TOKEN_CANDIDATES


def test_wan_and_ltx_chunk_by_their_cpu_table(monkeypatch):
    z_wan = torch.randn(1, 16, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    z_ltx = torch.randn(1, 128, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    for module, table, name, z in (
        (wan, wan_decode, "wan2.1-tiny", z_wan),
        (ltx, ltx_decode, "ltx-tiny", z_ltx),
    ):
        decoder = _seeded(module, name)
        with torch.inference_mode():
            default = list(decoder.iter_decode(z))
            monkeypatch.setitem(table.CHUNK_FRAMES, "cpu", 1)
            one = list(decoder.iter_decode(z))
        assert len(one) > len(default), name
        assert torch.allclose(torch.cat(one, 2), torch.cat(default, 2), atol=1e-5), name


def test_minimax_tokens_per_call_follow_its_cpu_table(monkeypatch):
    decoder = _seeded(minimax_h3, "minimax-h3-tiny")
    shape = (1, decoder.latent_channels, 9, 32, 32)  # several tiles a clip
    before = decoder.working_bytes(shape, 4)
    monkeypatch.setitem(mm_decode.BATCH_TOKENS, "cpu", 1)  # one tile a call
    assert decoder.working_bytes(shape, 4) < before


def test_every_family_names_a_gpu_conv3d_layout():
    """Each descriptor's ``gpu_conv3d_layout`` (what ``modes.build`` lays a GPU copy out in)
    is a layout ``set_conv3d_layout`` knows, and setting one lays out every 5-D weight."""
    layouts = {key: f.gpu_conv3d_layout for key, f in families().items()}
    assert set(layouts) == set(keys())
    assert set(layouts.values()) <= set(modes.CONV3D_LAYOUTS), layouts
    decoder = _seeded(wan, "wan2.1-tiny")
    modes.set_conv3d_layout(decoder, "channels_last_3d")
    weights = [p for p in decoder.parameters() if p.ndim == 5]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights)
    modes.set_conv3d_layout(decoder, "NCDHW")
    assert all(p.is_contiguous() for p in weights)
