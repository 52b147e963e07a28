"""The shell: a run built once (``Run``), the Prefect flows of the launcher, learners and
syncers, joining a run, the run's model read back, and the ``diloco`` command."""

from protocol.lazy import lazy_api

_API = {
    "Run": "flows.run",
    "initialize_run": "flows.run",
    "build_model": "flows.run",
    "train_flow": "flows.launcher",
    "learner_flow": "flows.learner",
    "LearnerRuntime": "flows.learner_runtime",
    "syncer_flow": "flows.syncer",
    "SyncerRuntime": "flows.syncer",
    "join_and_train": "flows.join",
    "read_global_model": "flows.model_io",
    "export_model": "flows.model_export",
    "evaluate": "flows.model_io",
    "main": "flows.cli",
}
__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
