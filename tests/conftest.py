"""Two host devices for every test, so the data-parallel sharding inside a learner is
exercised everywhere. Must be set before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
