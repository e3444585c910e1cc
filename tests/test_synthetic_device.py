"""Every family's seeded weights can be made on the device the part lives on.

The GPU proof builds each part on the GPU and seeds it there (``init_synthetic`` with a CPU
generator): a helper tensor made on the CPU and added into a GPU weight stopped the H200 proof
for Wan 2.1 (2026-12-04). CI has no GPU, so the part is built on the meta device and every op
of the seeding is watched: none may mix a CPU tensor into the part's (``copy_`` and ``to``
move values across devices, which is allowed)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from app.families import families

MOVES = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.__setitem__}


class MixedDevices(TorchFunctionMode):
    """Records each op (other than a move) whose tensor arguments sit on two devices."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors if t.dim() > 0}  # 0-d ones broadcast
        if len(devices) > 1 and func not in MOVES:
            self.mixed.append(f"{getattr(func, '__name__', func)} on {sorted(devices)}")
        return func(*args, **kwargs)


def _parts():
    for key, fam in families().items():
        name, recipe = next(iter(fam.synthetic.items()))
        yield pytest.param(fam.decoder, recipe.config, id=f"{key}-decoder")
        if fam.encoder is not None and recipe.encoder_config is not None:
            yield pytest.param(fam.encoder, recipe.encoder_config, id=f"{key}-encoder")


@pytest.mark.parametrize(("part", "config"), list(_parts()))
def test_seeding_keeps_to_the_parts_device(part, config):
    with torch.device("meta"):
        module = part.module(dict(config))
    with MixedDevices() as watch:
        part.init_synthetic(module, torch.Generator().manual_seed(0))
    assert watch.mixed == [], f"seeding mixes devices: {watch.mixed[:3]}"
    assert {p.device.type for p in module.parameters()} == {"meta"}
