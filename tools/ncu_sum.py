"""Sum an Nsight Compute CSV dump by kernel name, for a quick per-kernel breakdown.

    ncu --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 ... > dump.csv
    python3 tools/ncu_sum.py dump.csv

Prints, per kernel (name cut to 60 characters), the summed duration, the number of
launches and the mean DRAM throughput (% of peak) when that metric was collected.
"""

from __future__ import annotations

import collections
import csv
import sys


def main(path: str) -> None:
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    time_ns = collections.OrderedDict()
    count = collections.Counter()
    dram = collections.defaultdict(list)
    for r in rows[1:]:
        name, value = r[ki][:60], float(r[vi].replace(",", ""))
        if r[mi] == "gpu__time_duration.sum":
            time_ns[name] = time_ns.get(name, 0.0) + value
            count[name] += 1
        elif r[mi].startswith("dram__throughput"):
            dram[name].append(value)
    for name, t in sorted(time_ns.items(), key=lambda x: -x[1]):
        d = dram.get(name)
        extra = f"  DRAM {sum(d) / len(d):5.1f}%" if d else ""
        print(f"{t / 1e3:10.1f} us  x{count[name]:3d}{extra}  {name}")
    print(f"{sum(time_ns.values()) / 1e3:10.1f} us total kernel time")


if __name__ == "__main__":
    main(sys.argv[1])
