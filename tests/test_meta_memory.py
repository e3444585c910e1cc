"""``bench.meta_memory.live_peak``: the live storage bytes of a call on the meta device,
whether an op ran or its result's layout was reused from an earlier call on the same layout."""

from __future__ import annotations

import torch

from bench.meta_memory import LiveStorage, live_peak

KIB4 = 1024 * 4  # the bytes of one float32 tensor of 1024 elements


def test_repeated_ops_count_each_fresh_storage_and_no_view():
    x = torch.empty(1024, device="meta")  # alive before the call: not counted

    def call():
        kept = [x * 2 for _ in range(3)]  # three storages; the 2nd and 3rd from the reused layout
        views = [k[:10] for k in kept]  # no storage of their own
        return kept, views, torch.cat(kept)

    assert live_peak(call) == 3 * KIB4 + 3 * KIB4


def test_temporaries_freed_in_a_loop_peak_at_one():
    x = torch.empty(1024, device="meta")

    def call():
        for _ in range(5):
            y = x * 2
            y.add_(1)  # in place: its own storage, nothing new
            del y

    assert live_peak(call) == KIB4


def test_a_reused_result_has_the_layout_the_op_returned():
    x = torch.empty(2, 8, 4, 4, device="meta").to(memory_format=torch.channels_last)
    with torch.inference_mode(), LiveStorage():
        first, again = torch.nn.functional.silu(x), torch.nn.functional.silu(x)
        flat = x.reshape(2, -1) @ torch.empty(128, 3, device="meta")
        flat_again = x.reshape(2, -1) @ torch.empty(128, 3, device="meta")
    assert first.stride() == again.stride() == x.stride() and again.device.type == "meta"
    assert first.untyped_storage().nbytes() == again.untyped_storage().nbytes()
    assert flat.shape == flat_again.shape == (2, 3)


def test_ops_on_real_tensors_run():
    """Same layouts, other values: off the meta device every op computes."""
    with torch.inference_mode(), LiveStorage():
        first, again = torch.ones(4) * 2, torch.full((4,), 5.0) * 2
    assert first.tolist() == [2.0] * 4 and again.tolist() == [10.0] * 4
