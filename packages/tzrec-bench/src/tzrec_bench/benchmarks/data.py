"""Reading a large event log: first load (streamed into the cache), cached load (mapped),
peak resident memory, and the cache's size on disk.

::

    python -m tzrec_bench.benchmarks.data --events 10e6 --folder /tmp/log-10m
    python -m tzrec_bench.benchmarks.data --events 50e6 --folder /tmp/log-50m --files 50

The log is generated once into ``--folder`` (Parquet files with string user and item ids,
``user``/``item``/``ts`` columns, users' events interleaved as in a production log), unless
it is already there. Each load runs in a fresh Python process, which reports its wall time
and its peak resident memory (``ru_maxrss``: mapped pages it touched count too), also net
of the peak after its imports (torch alone is a few hundred MiB); the first load starts from
an empty cache folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tzrec_ops.commandline import ArgumentParser

_CHILD = """
import json, resource, sys, time
from tzrec_bench.data import load_dataset
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the imports (torch)
started = time.perf_counter()
ds = load_dataset(sys.argv[1], cache_dir=sys.argv[2], columns="user=user,item=item,time=ts")
# what a trainer reads first: every row's length and the item ids' range
summary = [int(ds.lengths.max()), int(ds.item_ids.max())]
print(json.dumps({"seconds": time.perf_counter() - started, "events": ds.num_events,
                  "users": ds.num_users, "items": ds.num_items,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "baseline_rss": baseline}))
"""


def generate(folder: Path, events: int, files: int, seed: int = 0) -> None:
    """``events`` events of ``events // 50`` users over ``events // 100`` items (popularity
    skewed), times increasing, split over ``files`` Parquet files."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    num_users, num_items = max(events // 50, 1), max(events // 100, 1)
    per_file = -(-events // files)
    for index in range(files):
        count = min(per_file, events - index * per_file)
        users = rng.integers(0, num_users, count)
        items = np.minimum(rng.zipf(1.3, count) - 1, num_items - 1)
        items = (items * 2_654_435_761) % num_items  # spread popular items over the ids
        times = 1_600_000_000 + index * per_file + np.arange(count)
        table = pa.table({
            "user": pc.binary_join_element_wise("user-", pc.cast(pa.array(users), pa.string()),
                                                ""),
            "item": pc.binary_join_element_wise("sku-", pc.cast(pa.array(items), pa.string()),
                                                ""),
            "ts": times,
        })
        pq.write_table(table, folder / f"part-{index:04d}.parquet")


def _load(folder: Path, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(cache)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m tzrec_bench.benchmarks.data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=float, default=10e6, help="events to generate")
    parser.add_argument("--files", type=int, default=10, help="Parquet files to write")
    parser.add_argument("--folder", type=Path, required=True, help="where the log is written")
    parser.add_argument("--cache-dir", type=Path, help="default: FOLDER.cache")
    args = parser.parse_args(argv)
    events = int(args.events)
    cache = args.cache_dir or args.folder.with_name(args.folder.name + ".cache")
    if not any(args.folder.glob("*.parquet")):
        started = time.perf_counter()
        generate(args.folder, events, args.files)
        print(f"generated {events:,} events in {args.files} files in "
              f"{time.perf_counter() - started:.1f} s ({_size(args.folder) / 2**20:.0f} MiB)")
    shutil.rmtree(cache, ignore_errors=True)
    first = _load(args.folder, cache)
    cached = _load(args.folder, cache)
    size = _size(cache)
    print(f"log: {first['events']:,} events, {first['users']:,} users, {first['items']:,} "
          f"items; cache {size / 2**20:.0f} MiB on disk")
    for name, run in (("first load", first), ("cached load", cached)):
        grown = run["peak_rss"] - run["baseline_rss"]
        print(f"{name:12s} {run['seconds']:7.1f} s  {run['events'] / run['seconds']:12,.0f} "
              f"events/s  peak RSS {run['peak_rss'] / 2**20:6.0f} MiB "
              f"({run['peak_rss'] / size:.2f}x the cache; {grown / 2**20:.0f} MiB over the "
              f"{run['baseline_rss'] / 2**20:.0f} MiB of the imports: {grown / size:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
