"""A run in its buckets: the key tree, the Zarr encoding, write-once commits, and the
run's records by kind (``RunStore`` and its parts); inspection, audit and a notebook's
report. Named arrays and JSON only: no training types, no JAX."""

from protocol.lazy import lazy_api

_API = {
    "RunStore": "storage_layout.store",
    "SpecMismatch": "storage_layout.store",
    "RunLayout": "storage_layout.layout",
    "Bucket": "storage_layout.bucket",
    "BucketError": "storage_layout.bucket",
    "RegionDown": "storage_layout.store",
    "CommitConflict": "storage_layout.commit",
    "CorruptVersion": "storage_layout.commit",
    "Injector": "storage_layout.faults",
    "open_bucket": "storage_layout.faults",
    "inspect_bucket": "storage_layout.inspect",
    "audit_run": "storage_layout.audit",
    "load": "storage_layout.report",
}
__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
