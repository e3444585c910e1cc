"""Series per replica (docs/metrics.md, "Series per replica"): after one request per model and
output (and a refused one), each model's series stay within the budget that keeps the default
store under 1,500 series on Managed Prometheus, which bills every sample it ingests: each series,
one sample per scrape."""

from __future__ import annotations

import requests

from bench.series import count_series, send_each
from tests.live import TINY_FLUX

# x 9 models of the default store + the model-less series < 1,500. 160, was 150: each model's
# refusal (429, 500, 503) and device-retry label sets now exist at 0 from its start (5 series,
# Metrics.init_labels), so that a first burst is an increase Prometheus sees (issue 36.5).
PER_MODEL = 160
MODEL_LESS = 20


def test_series_per_model_stay_within_budget(flux_server):
    models = requests.get(f"{flux_server}/models", timeout=30).json()["models"]
    assert {m["name"] for m in models} == set(TINY_FLUX)
    for _ in range(2):  # a second round adds observations, not series
        codes = send_each(flux_server, models)
    assert set(codes.values()) == {200}, codes
    # a refused request (wrong channel count) has its own outcome series
    bad = requests.post(f"{flux_server}/decode/flux-tiny", params={"shape": [1, 4, 2, 2]},
                        data=b"\0" * 64, headers={"Content-Type": "tensor/binary"})  # fmt: skip
    assert bad.status_code == 422
    text = requests.get(f"{flux_server}/metrics", timeout=30).text
    total, per_model = count_series(text)
    assert per_model[""] <= MODEL_LESS, per_model
    for model in TINY_FLUX:
        assert 0 < per_model[model] <= PER_MODEL, (model, per_model[model])
    assert "_created" not in text and "_bucket{" in text
    # phases keep their totals, quantiles come from the three spans
    assert 'vae_phase_seconds_sum{device="cpu",model="flux-tiny",phase="up_0"}' in text
    assert "vae_phase_seconds_bucket" not in text
    for span in ("queue", "decode", "encode"):
        assert f'model="flux-tiny",span="{span}"' in text, span
    assert total == sum(per_model.values())
