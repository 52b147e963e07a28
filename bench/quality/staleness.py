"""One simulated run's merges: the staleness of what each version merged, how many
contributions each merged, the sums of their weights, and the final validation loss.

    python bench/quality/staleness.py [--preset small] sim.step_seconds=0.03 ...

The run is ``bench/quality/share.md``'s: decoupled, ``tiny`` (or ``--preset``), 4
learners of speeds 1, 1, 2 and 3, 4 fragments, int4 outer gradients, 1 M tokens, seed 0;
the other arguments are more config overrides. It tells a pipeline's merges from the simulator's (``sim.step_seconds``
against the syncers' round trip: ``tiny``'s steps on these CPUs take about 30 ms).
"""

from __future__ import annotations

import collections
import sys

from diloco.config import load_config
from diloco.simulate import simulate

RUN = ["topology.learners=4", "topology.fragments=4", "topology.quantization=int4",
       "budget.tokens=1000000", "sim.speeds=[1,1,2,3]", "seed=0"]  # fmt: skip


def main(args: list[str]) -> int:
    preset, overrides = (args[1], args[2:]) if args[:1] == ["--preset"] else ("tiny", args)
    res = simulate(load_config(preset, overrides=[*RUN, *overrides], mode="decoupled"))
    versions = [m for m in res.metrics if m["event"] == "version" and m["consumed"]]
    staleness = collections.Counter(s for v in versions for s in v["staleness"].values())
    merged = collections.Counter(len(v["consumed"]) for v in versions)
    sums = [sum(v["weights"].values()) for v in versions]
    print(f"versions {len(versions)}; staleness {dict(sorted(staleness.items()))}; "
          f"contributions a merge {dict(sorted(merged.items()))}; weight sum mean "
          f"{sum(sums) / len(sums):.3f}, below 1 in {sum(s < 0.999 for s in sums)}; "
          f"final loss {res.summary['final_loss']:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
