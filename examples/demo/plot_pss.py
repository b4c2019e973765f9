"""Plot the summed PSS of all ranks over time, BASE against dedup, one panel per setting.

Reads the CSV that demo::write_pss_csv writes (pss.hpp):

    setting,arm,rank,t_seconds,memory_bytes

and writes a PNG. Each rank samples on its own clock ticks, so every rank's series is
held constant from one sample to the next and the ranks are summed on a common time grid;
a rank counts only between its first and its last sample (before and after, it has no
process). Prints the peak and median of each sum.

    python plot_pss.py pss.csv pss.png
"""

import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # no display on a training node
import matplotlib.pyplot as plt
import numpy as np

ARM_ORDER = ("BASE", "dedup (network)", "dedup (same host)")
ARM_COLOURS = {"BASE": "tab:red", "dedup (network)": "tab:orange", "dedup (same host)": "tab:blue"}
GIB = float(1 << 30)


def read_series(path):
    """{setting: {arm: {rank: (t array, pss array)}}}, each series sorted by time."""
    raw = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"setting", "arm", "rank", "t_seconds", "memory_bytes"} - set(reader.fieldnames or ())
        if missing:
            sys.exit(f"{path}: missing column(s) {', '.join(sorted(missing))}; "
                     "expected setting,arm,rank,t_seconds,memory_bytes")
        for row in reader:
            raw[row["setting"]][row["arm"]][int(row["rank"])].append(
                (float(row["t_seconds"]), float(row["memory_bytes"])))
    series = {}
    for setting, arms in raw.items():
        series[setting] = {}
        for arm, ranks in arms.items():
            series[setting][arm] = {}
            for rank, points in ranks.items():
                points.sort()
                t, pss = zip(*points)
                series[setting][arm][rank] = (np.array(t), np.array(pss))
    if not series:
        sys.exit(f"{path}: no samples")
    return series


def summed(ranks):
    """(grid, total): the ranks' PSS summed on a common time grid."""
    starts = [t[0] for t, _ in ranks.values()]
    ends = [t[-1] for t, _ in ranks.values()]
    steps = [np.median(np.diff(t)) for t, _ in ranks.values() if len(t) > 1]
    step = min(steps) if steps else 1.0
    grid = np.append(np.arange(min(starts), max(ends), step), max(ends))
    total = np.zeros_like(grid)
    for t, pss in ranks.values():
        held = pss[np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 1)]
        total += np.where((grid >= t[0]) & (grid <= t[-1]), held, 0.0)
    return grid, total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="input CSV (setting,arm,rank,t_seconds,memory_bytes)")
    parser.add_argument("png", help="output PNG")
    parser.add_argument("--title", default="CPU memory of all ranks (summed PSS)")
    args = parser.parse_args()

    series = read_series(args.csv)
    settings = sorted(series)
    fig, axes = plt.subplots(len(settings), 1, figsize=(9, 3.2 * len(settings)), squeeze=False)
    for ax, setting in zip(axes[:, 0], settings):
        arms = sorted(series[setting], key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else len(ARM_ORDER), a))
        for arm in arms:
            ranks = series[setting][arm]
            grid, total = summed(ranks)
            peak, median = total.max() / GIB, np.median(total) / GIB
            print(f"{setting} {arm}: {len(ranks)} ranks, peak {peak:.2f} GiB, median {median:.2f} GiB")
            ax.plot(grid, total / GIB, color=ARM_COLOURS.get(arm), drawstyle="steps-post",
                    label=f"{arm} ({len(ranks)} ranks, peak {peak:.2f} GiB, median {median:.2f} GiB)")
        ax.set_title(setting)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("summed PSS (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
