"""The seed's graph from run.sh's JSON lines: ``python plot.py results.jsonl first-step.png``.

Each line of results.jsonl is one run.sh line with a "config" label added; where a
configuration has several runs at a rank count, the median is drawn and the runs as dots."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ORDER = ["no cache", "asyncclcache cold", "asyncclcache warm, new nodes"]


def main(src: str, png: str) -> None:
    runs: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    with open(src) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs[r["config"]][r["R"]].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("to_first_step_s", "seconds to the end of the first step (slowest rank)"),
              ("cpu_s", "CPU seconds of the whole job")]
    for ax, (field, title) in zip(axes, panels, strict=True):
        for config in [c for c in ORDER if c in runs] + [c for c in runs if c not in ORDER]:
            by_r = runs[config]
            rs = sorted(by_r)
            med = [statistics.median(x[field] for x in by_r[R]) for R in rs]
            line, = ax.plot(rs, med, marker="o", label=config)
            for R in rs:
                if len(by_r[R]) > 1:
                    ax.scatter([R] * len(by_r[R]), [x[field] for x in by_r[R]], s=10,
                               color=line.get_color(), alpha=0.5)
        ax.set_xlabel("MPI ranks on 2 cores")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=9)
    fig.suptitle("grudge wave-op-mpi.py --lazy, every cache empty (warm: only the cache directory kept)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
