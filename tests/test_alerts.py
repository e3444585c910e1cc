"""Alerts an operator can act on (issue 36, items 4-6).

* Every rule of both rule files imports into Cloud Monitoring with a subject and documentation:
  the rules go through the same conversion as ``gcloud monitoring policies migrate``.
* On Cloud Run, ``VaeNoReadyReplica`` reads Cloud Run's own startup-probe metric (the metrics
  sidecar never scrapes a replica that does not get ready); promtool's unit tests
  (deploy/prometheus/alerts-cloudrun_test.yml, run by tests/test_deploy.py) show it firing.
* A fresh server exports the label sets that alerts and panels watch at 0, so its first burst
  of 429s is an increase a real Prometheus sees: ``VaeShedding`` goes pending.
* ``vae_model_load_seconds{phase="total"}`` stays the time until a model served; the modes
  measured after ready are ``phase="select"``.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
from typing import Any

import pytest
import requests
import yaml

from tests import faulty
from tests.helpers import faulty_family, occupy, post, wait_queued
from tests.live import live_server
from tests.test_deploy import PROM_DIR, ROOT, running_prometheus

__all__ = ["faulty_family"]  # the module-scoped fixture that registers the faulty family

RULE_FILES = ("alerts.yml", "alerts-cloudrun.yml")

# --- the import into Cloud Monitoring ------------------------------------------------------

# What `gcloud monitoring policies migrate --policies-from-prometheus-alert-rules-yaml` does with
# a rule (the Google Cloud SDK's monitoring command library: PrometheusMessageFromString and
# TranslatePromQLTemplateToDocumentVariables): one policy per rule, named "group/alert"; the
# condition is the rule's expr, for and labels; of the annotations only `subject` (the
# documentation's subject) and `description` (its content) are read; in them only these three
# template forms are translated to document variables, everything else stays as written.
_VALUE = re.compile(r"\{\{ *(humanize )? *\$value *\}\}")
_LABELS = re.compile(r"\{\{ *(humanize )? *\$labels *\}\}")
_LABEL = re.compile(r"\{\{ *(humanize )? *\$labels\.([a-zA-Z_][a-zA-Z0-9_]*) *\}\}")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SUBJECT_MAX = 255  # Cloud Monitoring's limit on a documentation subject, in characters


def _document(template: str) -> str:
    template = _VALUE.sub(r"${metric.label.value}", template)
    template = _LABELS.sub(r"${metric_or_resource.labels}", template)
    return _LABEL.sub(r"${metric_or_resource.label.\2}", template)


def imported_policy(group: dict[str, Any], rule: dict[str, Any]) -> dict[str, Any]:
    """The alerting policy gcloud's migration makes of one Prometheus rule."""
    for field in (group.get("name"), rule.get("alert"), rule.get("expr")):
        assert field is not None, (group.get("name"), rule)  # gcloud refuses the file
    assert _LABEL_NAME.fullmatch(rule["alert"]), rule["alert"]
    name = group["name"] if _LABEL_NAME.fullmatch(group["name"]) else f'"{group["name"]}"'
    condition = {"ruleGroup": group["name"], "alertRule": rule["alert"], "query": rule["expr"],
                 "duration": rule.get("for"), "labels": rule.get("labels")}  # fmt: skip
    policy: dict[str, Any] = {"displayName": f"{name}/{rule['alert']}",
                              "conditions": [{"conditionPrometheusQueryLanguage": condition}]}  # fmt: skip
    annotations = rule.get("annotations")
    if annotations is not None:
        documentation = {"mimeType": "text/markdown"}
        if annotations.get("subject") is not None:
            documentation["subject"] = _document(annotations["subject"])
        if annotations.get("description") is not None:
            documentation["content"] = _document(annotations["description"])
        policy["documentation"] = documentation
    return policy


def _rules(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    groups = yaml.safe_load((PROM_DIR / name).read_text())["groups"]
    return [(group, rule) for group in groups for rule in group["rules"]]


def _grouping(expr: str) -> set[str]:
    """The labels an alert's series keep: those of every ``by (...)`` in its expression."""
    return {label.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr)
            for label in by.split(",") if label.strip()}  # fmt: skip


def test_the_conversion_is_gcloud_s():
    rule = {"alert": "A", "expr": "up == 0", "for": "5m", "labels": {"severity": "critical"},
            "annotations": {"summary": "dropped", "subject": "{{ $labels.job }} {{$value}}",
                            "description": "{{ humanize $value }} of {{ $labels }}; "
                                           "{{ $value | humanizePercentage }}"}}  # fmt: skip
    policy = imported_policy({"name": "my-group"}, rule)
    assert policy["displayName"] == '"my-group"/A'
    assert policy["documentation"] == {
        "mimeType": "text/markdown",
        "subject": "${metric_or_resource.label.job} ${metric.label.value}",
        "content": "${metric.label.value} of ${metric_or_resource.labels}; "
        "{{ $value | humanizePercentage }}",  # a pipe is not translated
    }
    assert "summary" not in str(policy)
    assert "documentation" not in imported_policy({"name": "g"}, {"alert": "B", "expr": "1"})


def test_every_rule_imports_with_a_subject_and_documentation():
    """Both rule files: every policy has a subject and documentation content, none keeps a
    template the import does not translate (it would reach the operator as written), and each
    label a document variable names is one the alert's series keep (else: "(none)")."""
    problems = []
    for name in RULE_FILES:
        rules = _rules(name)
        assert len(rules) == 9, name
        for group, rule in rules:
            where = f"{name}: {rule['alert']}"
            documentation = imported_policy(group, rule).get("documentation", {})
            subject, content = documentation.get("subject", ""), documentation.get("content", "")
            if not subject.strip() or not content.strip():
                problems.append(f"{where}: no subject or no documentation")
            if "{{" in subject + content:
                problems.append(f"{where}: a template the import leaves as written")
            if len(subject) > SUBJECT_MAX:
                problems.append(f"{where}: subject of {len(subject)} characters")
            named = set(re.findall(r"\$\{metric_or_resource\.label\.(\w+)\}", subject + content))
            if named - _grouping(rule["expr"]):
                problems.append(f"{where}: names {named - _grouping(rule['expr'])}, not kept")
            if not rule["annotations"].get("summary"):
                problems.append(f"{where}: no summary (Alertmanager's)")
    assert not problems, "\n".join(problems)


def _render_alerts() -> Any:
    spec = importlib.util.spec_from_file_location(
        "render_alerts", ROOT / "scripts/render_alerts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_ready_replica_on_cloud_run_reads_cloud_run_s_startup_probes():
    """The sidecar starts after the startup probe passes: on Cloud Run the rule is on Cloud
    Run's own metric, scoped to the service; the self-hosted rule stays on the scrape (a
    self-hosted Prometheus scrapes replicas that are not ready)."""
    cloud_run = {r["alert"]: r for _, r in _rules("alerts-cloudrun.yml")}["VaeNoReadyReplica"]
    expr = cloud_run["expr"]
    probes = re.findall(r"run_googleapis_com:container_completed_probe_count\{([^}]*)\}", expr)
    assert len(probes) == 2, expr
    for selector in probes:
        assert (
            'service_name="vae-render"' in selector
            and 'monitored_resource="cloud_run_revision"' in selector
        )
        assert 'probe_type=~"(?i)startup"' in selector
    assert {'is_healthy="false"', 'is_healthy="true"'} <= set(re.findall(r'is_healthy="\w+"', expr))
    assert not re.search(r"\b(vae_\w+|up)\{", expr), "nothing the sidecar scrapes"
    self_hosted = {r["alert"]: r for _, r in _rules("alerts.yml")}["VaeNoReadyReplica"]["expr"]
    assert 'up{job="vae"}' in self_hosted and "vae_model_load_seconds" in self_hosted
    # another service name: the probes of that service
    other = _render_alerts().render((PROM_DIR / "alerts.yml").read_text(), service="my-vae")
    rules = {r["alert"]: r for g in yaml.safe_load(other)["groups"] for r in g["rules"]}
    assert rules["VaeNoReadyReplica"]["expr"].count('service_name="my-vae"') == 2
    # the replica in the annotations is the sidecar's instanceId ("instance" is 8080 on all)
    for field in ("subject", "description"):
        text = rules["VaeTargetDown"]["annotations"][field]
        assert "{{ $labels.instanceId }}" in text and "{{ $labels.instance }}" not in text


# --- a fresh server's first burst, in a real Prometheus ------------------------------------

SCRAPE_S = 1  # scrape and rule evaluation interval of the test's Prometheus
HOLD_TAG, QUEUED_TAG = 36051.0, 36052.0  # unique in the session: HOLD gates are files
BURST = 25


def _alerts(prom, name: str) -> list[dict[str, Any]]:
    return [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == name]


def test_a_fresh_server_s_first_burst_of_429s_makes_vae_shedding_pending(tmp_path):
    """A fresh server (one worker, a queue of one) exports its 429 label sets at 0, Prometheus
    scrapes them, then the first burst of 429s arrives: VaeShedding is pending within a scrape
    and an evaluation. A label set born in the burst (404s) shows why: rate() sees no increase."""
    store = tmp_path / "store"
    faulty.bake(store, "faulty")
    limits = dict(queue_depth=1, max_batch=1, batch_rows=1)
    with live_server(store, device="cpu", dtype="float32", **limits) as url:
        fresh = requests.get(f"{url}/metrics", timeout=10).text
        for labels in ('code="429",model="faulty",output="-"', 'code="503",model="-",output="-"',
                       'code="200",model="faulty",output="png"'):  # fmt: skip
            assert f"vae_requests_total{{{labels}}} 0.0" in fresh, labels
        assert 'vae_retries_total{model="faulty",path="tiled",reason="oom"} 0.0' in fresh
        interval = f"{SCRAPE_S}s"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(PROM_DIR / "alerts.yml")],
            "scrape_configs": [{
                "job_name": "vae", "scrape_interval": interval, "scrape_timeout": interval,
                "static_configs": [{"targets": [url.removeprefix("http://")]}],
            }],
        }  # fmt: skip
        (tmp_path / "prometheus").mkdir()
        with running_prometheus(config, tmp_path / "prometheus") as prom:
            shed = 'vae_requests_total{job="vae", model="faulty", code="429"}'
            prom.wait("the fresh server's 0 scraped", lambda: prom.value(shed) == 0, timeout=60)
            assert not _alerts(prom, "VaeShedding")
            threads = [occupy(url, HOLD_TAG)]  # the worker holds a decode ...
            try:
                queued = threading.Thread(
                    target=post, args=(url, faulty.latent(faulty.HOLD, tag=QUEUED_TAG))
                )
                queued.start()
                threads.append(queued)
                wait_queued(url, 1)  # ... and the queue of one is full
                codes = [post(url, faulty.latent()).status_code for _ in range(BURST)]
                burst_at = time.monotonic()
                assert codes == [429] * BURST, codes
                for _ in range(3):  # a label set the burst creates: born at its count
                    assert post(url, faulty.latent(), model="no-such-model").status_code == 404
                prom.wait("VaeShedding pending", lambda: _alerts(prom, "VaeShedding"), timeout=30)
                pending_after = time.monotonic() - burst_at
                (alert,) = _alerts(prom, "VaeShedding")
                assert alert["state"] == "pending" and alert["labels"]["model"] == "faulty", alert
                assert float(alert["value"]) > 0
                born = 'vae_requests_total{job="vae", model="-", code="404"}'
                prom.wait("the 404s scraped", lambda: prom.value(born) == 3)
                time.sleep(2 * SCRAPE_S)  # more scrapes of the same count
                (series,) = prom.query(f"{born}[5m]")  # its raw samples
                first = float(series["values"][0][1])
                assert first > 0, series  # born at its count: no 0 before it
                if first == 3:  # (a loaded machine may scrape between the three 404s)
                    assert prom.value(f"sum(increase({born}[5m]))") == 0  # invisible
                assert prom.value(f"sum(increase({shed}[5m]))") >= BURST
            finally:
                faulty.release(HOLD_TAG, QUEUED_TAG)
                for thread in threads:
                    thread.join(30)
    print(f"VaeShedding pending {pending_after:.2f} s after the burst "
          f"(scrape and evaluation every {SCRAPE_S} s)")  # fmt: skip
    # a scrape, then an evaluation: about 2 intervals; the rest is slack for a loaded machine
    assert pending_after < 10 * SCRAPE_S


# --- vae_model_load_seconds: total is the time to serve, the after-ready work its own phase ---


@pytest.mark.bf16_order
def test_load_total_is_the_time_to_serve_and_the_after_ready_selection_is_select(tmp_path):
    """On the CPU with VAE_DTYPE=auto the exact path serves first and the modes are measured
    after ready: that measurement is phase "select", and "total" stays the time until the model
    first served (it was overwritten by the measurement's end: 2.4 s became 168 s)."""
    store = tmp_path / "store"
    faulty.bake(store, "faulty")
    with live_server(store, device="cpu", dtype="auto") as url:

        def described() -> dict[str, Any]:
            return requests.get(f"{url}/models", timeout=10).json()["models"][0]

        faulty.wait_for(
            "the modes measured after ready", lambda: described()["selection"] == "done"
        )
        model = described()
        text = requests.get(f"{url}/metrics", timeout=10).text
    load = {m["phase"]: float(v) for m, v in
            ((dict(re.findall(r'(\w+)="([^"]*)"', labels)), v) for labels, v in
             re.findall(r"^vae_model_load_seconds\{([^}]*)\} (\S+)$", text, re.M))
            if m["model"] == "faulty"}  # fmt: skip
    assert {"hash", "map", "build", "total", "select"} <= set(load) and "gate" not in load, load
    assert load["total"] <= model["state_seconds"]["ready"] + 0.001, (load, model)
    assert load["select"] == model["phase_seconds"]["select"] > 0, (load, model)
    assert "gate" not in model["phase_seconds"], model  # nothing was gated before ready
