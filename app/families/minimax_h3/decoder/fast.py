"""The MiniMax-H3 fast path: the blocks' arithmetic in fewer passes over memory, served only
behind the parity gate.

``optimize`` swaps the block stack for ``FastBlocks`` of ``FastBlock`` (the same parameter
objects under the same names):
  * the SwiGLU input projection runs as two GEMMs over its weight's value and gate halves
    (views: no copy), which come out contiguous, so SiLU and the gating multiply run in place:
    one intermediate of the projection's size is held instead of two;
  * each residual update is one fused multiply-add, in place on the stack's private copy of
    the residual stream.
The sums are the reference's; only their rounding order may differ (the gate measures it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from app.families.minimax_h3.decoder.model import Architecture, Block, FeedForward, Rope


class GatedFeedForward(nn.Module):
    """``model.FeedForward`` with its gated projection split into halves, SwiGLU in place."""

    def __init__(self, ff: FeedForward) -> None:
        super().__init__()
        self.net = ff.net  # the same modules under the same names

    def forward(self, x: Tensor) -> Tensor:
        proj = self.net[0].proj
        half = proj.out_features // 2  # rows: [value; gate]
        gate = F.linear(x, proj.weight[half:], proj.bias[half:])
        value = F.linear(x, proj.weight[:half], proj.bias[:half])
        return self.net[2](value.mul_(F.silu(gate, inplace=True)))


class FastBlock(nn.Module):
    """``model.Block`` updating the residual stream ``x`` in place."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.norm1, self.attn, self.scale1 = block.norm1, block.attn, block.scale1
        self.norm2, self.scale2 = block.norm2, block.scale2
        self.ff = GatedFeedForward(block.ff)

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        dtype = self.attn.to_q.weight.dtype
        x.addcmul_(self.attn(self.norm1(x).to(dtype), rope), self.scale1.float())
        return x.addcmul_(self.ff(self.norm2(x).to(dtype)), self.scale2.float())


class FastBlocks(nn.ModuleList):
    """The blocks in order, on a copy of the caller's residual stream."""

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        x = x.clone()
        for block in self:
            x = block(x, rope)
        return x


def optimize(model: Architecture) -> None:
    vit = model.decoder
    vit.transformer_blocks = FastBlocks(FastBlock(b) for b in vit.transformer_blocks)
