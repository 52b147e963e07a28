"""What runs around the training code: servers for tests and the local stack (S3 and GCS
on loopback, a Prefect server), the local multi-region stack itself, process chaos and
the helpers that start and stop processes, and the Prefect automations a deployment
installs. ``terraform/``, ``kubernetes/`` and ``container/`` hold the cloud definitions."""

from protocol.lazy import lazy_api

_API = {
    "LocalS3": "infra.local_servers",
    "LocalGCS": "infra.local_servers",
    "prefect_server": "infra.prefect_server",
    "Chaos": "infra.chaos",
    "ChaosPlan": "infra.chaos",
    "read_actions": "infra.chaos",
    "stop_leftovers": "infra.processes",
}
__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
