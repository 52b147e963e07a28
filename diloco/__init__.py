"""The algorithm, pure: the config, the learner and syncer loops, the merge rules and the
outer step, the model and its trainer, a run's data, and the simulator that drives the
loops on a virtual clock. No storage, no Prefect (docs/architecture.md)."""

from protocol.lazy import lazy_api

_API = {
    "RunConfig": "diloco.config",
    "ConfigError": "diloco.config",
    "load_config": "diloco.config",
    "validate_config": "diloco.config",
    "LearnerLoop": "diloco.learner_loop",
    "SyncerLoop": "diloco.syncer_loop",
    "WallClock": "diloco.loops",
    "drive": "diloco.loops",
    "SimResult": "diloco.simulate",
    "Scheduler": "diloco.scheduler",
    "VirtualClock": "diloco.scheduler",
    "RunData": "diloco.run_data",
    "settle_assign": "diloco.run_data",
    "MERGE_RULES": "diloco.merge",
    "merge_rule": "diloco.merge",
    "Contribution": "diloco.outer",
    "outer_optimizer": "diloco.outer",
    "FragmentSyncer": "diloco.syncer",
    "ParamCodec": "diloco.model",
    "InnerTrainer": "diloco.inner",
}
__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
