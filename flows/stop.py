"""A worker process's stop (``flows.worker``): one flag the learner and syncer flows look
at, in a module of its own so that they need not import the entry module."""

from __future__ import annotations

import threading

# Set by a stop (SIGINT: the launcher's, or a Ctrl-C; SIGTERM to a syncer) as well as
# raised: the KeyboardInterrupt is lost where it lands in a JAX garbage collector callback
# (Python ignores it there) or as a flow run ends (Prefect's engine swallows an exception
# raised after the flow's own code returned), and the worker would train on. The learner
# and syncer flows look at it every round or poll, the worker between flow runs. A
# signal is the process's, so the flag is too.
STOP = threading.Event()
