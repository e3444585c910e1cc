"""deploy/prometheus/alerts.yml for another scrape job, or for Cloud Run's Managed Prometheus.

    python scripts/render_alerts.py --job JOB [-o OUT]            # a self-hosted job name
    python scripts/render_alerts.py --cloud-run SERVICE [-o OUT]  # Managed Prometheus sidecar

Every selector of the rules names the scrape job, ``job="vae"`` (deploy/prometheus/prometheus.yml).
Cloud Run's sidecar (run-gmp-sidecar) reports ``job="run-gmp-sidecar"`` for every service that
uses it, so there the service is told apart by the sidecar's ``service_name`` label (the Cloud
Run service's name). deploy/prometheus/alerts-cloudrun.yml is ``--cloud-run vae-render``; the
output imports into Cloud Monitoring as alerting policies (deploy/README.md). For Cloud Run also:

* an annotation's ``{{ $labels.instance }}`` becomes ``{{ $labels.instanceId }}`` (the sidecar's
  ``instance`` is "8080" on every replica; the import translates only plain label references,
  not ``or``, so the ``subject`` and ``description`` cannot pick one themselves);
* ``VaeNoReadyReplica`` is replaced by a rule on Cloud Run's own startup-probe metric: the
  sidecar starts after the service's startup probe passes, so it never scrapes a replica that
  does not get ready.

Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"
SELF_HOSTED_JOB = 'job="vae"'
SIDECAR_JOB = "run-gmp-sidecar"  # what run-gmp-sidecar sets on every series it exports
_PLAIN = re.compile(r"[A-Za-z0-9_.:/-]+")
INSTANCE = "{{ $labels.instance }}"  # the replica, in a self-hosted rule's annotations
INSTANCE_ID = "{{ $labels.instanceId }}"  # ... and under the sidecar

# Cloud Run's own metric run.googleapis.com/container/completed_probe_count, in PromQL (Cloud
# Monitoring's names: the first "/" becomes ":", other "/" and "." become "_"), of this service's
# startup probes; written by Cloud Run whether or not the service's sidecar ever runs.
_PROBES = (
    'run_googleapis_com:container_completed_probe_count{monitored_resource="cloud_run_revision", '
    'service_name="SERVICE", probe_type=~"(?i)startup", is_healthy="HEALTHY"}'
)
NO_READY_REPLICA_CLOUD_RUN = """\
      - alert: VaeNoReadyReplica
        # Cloud Run: the metrics sidecar starts only after the service container's startup
        # probe passes (container-dependencies in deploy/cloudrun/service.yaml), so a replica
        # that never gets ready is never scraped: no `up`, no vae_* series. Cloud Run itself
        # counts every startup probe that ended, healthy or not (is_healthy), in
        # run.googleapis.com/container/completed_probe_count (sampled every 60 s, visible up to
        # 120 s later). This fires when a revision's replicas fail their startup probe (/readyz
        # not 200 within 30 x 2 s, and Cloud Run stops them) and none has passed it for 10
        # minutes. A service scaled to zero starts nothing: no probe, no alert.
        expr: >-
          (sum by (revision_name) (increase(FAILED[10m])) > 0)
            unless on (revision_name)
          (sum by (revision_name) (increase(PASSED[10m])) > 0)
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: "revision {{ $labels.revision_name }}: replicas fail their startup probe, none gets ready"
          subject: "VAE render: revision {{ $labels.revision_name }}: {{ $value }} failed startup probes, no replica ready"
          description: >-
            Replicas of revision {{ $labels.revision_name }} failed their startup probe on
            /readyz ({{ $value }} in 10 minutes) and none passed it: no model was loaded and
            gated within the probe's 60 s, or every model failed. Cloud Run stops each one. The
            replicas' logs (the "runtime:" line, "model ... not served") say why; GET /models of
            a replica that started says how long each phase took.
"""


def _selector(job: str | None, service: str | None) -> str:
    if (job is None) == (service is None):
        raise ValueError("give one of job and service")
    name = job if job is not None else service
    if not _PLAIN.fullmatch(name or ""):
        raise ValueError(f"not a plain name: {name!r}")
    if job is not None:
        return f'job="{job}"'
    return f'job="{SIDECAR_JOB}", service_name="{service}"'


def render(text: str, job: str | None = None, service: str | None = None) -> str:
    """The rules with every ``job="vae"`` selector replaced (a job name, or a Cloud Run service
    behind the Managed Prometheus sidecar, which also gets its own ``VaeNoReadyReplica`` and
    names the replica by ``instanceId`` in the annotations)."""
    if SELF_HOSTED_JOB not in text:
        raise ValueError(f"{SELF_HOSTED_JOB} not found: alerts.yml changed, update this script")
    selector = _selector(job, service)
    if service is not None:
        probes = _PROBES.replace("SERVICE", service)
        block = NO_READY_REPLICA_CLOUD_RUN.replace("FAILED", probes.replace("HEALTHY", "false"))
        block = block.replace("PASSED", probes.replace("HEALTHY", "true"))
        text = _replace_rule(text, "VaeNoReadyReplica", block)
    lines = []
    for line in text.splitlines(keepends=True):
        if not line.lstrip().startswith("#"):
            line = line.replace(SELF_HOSTED_JOB, selector)
            if service is not None:
                line = line.replace(INSTANCE, INSTANCE_ID)
        lines.append(line)
    header = (
        f"# GENERATED from alerts.yml by scripts/render_alerts.py for {selector}: do not edit.\n"
    )
    return header + "".join(lines)


def _replace_rule(text: str, alert: str, block: str) -> str:
    """``text`` with the rule ``alert`` (its lines up to the next rule, group or blank line)
    replaced by ``block``."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == f"- alert: {alert}"]
    if len(starts) != 1:
        raise ValueError(f"rule {alert} not found once: alerts.yml changed, update this script")
    start = end = starts[0]
    while end + 1 < len(lines) and lines[end + 1].strip() and "- alert:" not in lines[end + 1]:
        if lines[end + 1].lstrip().startswith("- name:"):
            break
        end += 1
    return "".join(lines[:start]) + block + "".join(lines[end + 1 :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--job", help="the job label of the service's series (self-hosted)")
    target.add_argument("--cloud-run", metavar="SERVICE", help="the Cloud Run service's name")
    parser.add_argument("-o", "--output", type=Path, help="default: stdout")
    args = parser.parse_args(argv)
    text = render(ALERTS.read_text(), job=args.job, service=args.cloud_run)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
