"""Mosaic Streaming (MDS): conversion rows/s, and input samples/s of the shards vs in memory.

(a) Conversion: the same rows (``--rows`` rows of int64, int64, float64 and a float32
``ndarray`` column, generated in memory from a fixed seed and held as a dict of numpy
columns) become MDS shards, alternately (A, A', B, A, A', B, ...) through

- A: ``prefect_sgpu.pipeline.mds.write_mds(columns_dict, out)`` as the ``prepare_mds`` task
  calls it by default (it fingerprints the source, infers the column types from the first
  rows and checks every later row against them, shows a progress bar, and writes beside
  the final folder, renaming it in when complete),
- A': the same with ``columns=`` given (the types A inferred), which skips the per-row
  type checks, and
- B: ``streaming.MDSWriter`` used directly, with those column types, the same compression
  and size limit, and the same row dicts built from the columns.

Each run writes into a fresh folder, deleted after it. Target: ratio (A / B) >= 0.95.

(b) Input: one set written by ``write_mds`` is read back in this one process (a single
rank), alternately (A, A', B, ...) through

- A: the project's ``streaming_loader`` (a ``StreamingDataset`` in a ``StreamingDataLoader``),
- A': ``streaming.StreamingDataset`` in a plain torch ``DataLoader`` (no project code), and
- B: the same columns in memory, a ``TensorDataset`` in a torch ``DataLoader``,

with the same batch size, all shuffled, ``--workers`` loader workers each. Every run builds
a new dataset and loader and reads one full epoch; samples/s is the samples yielded over
the time of that epoch (building the loader is timed apart). One untimed epoch of each
comes first; the very first read of a compressed set decompresses its shards beside them,
reported apart as the cold epoch. After every streaming run its dataset is dropped and
``streaming.base.util.clean_stale_shared_memory()`` runs, which removes *every* streaming
block in this host's /dev/shm: do not run this beside another job that uses streaming on
the same host (or give it a /dev/shm of its own, e.g. ``unshare --mount`` with a tmpfs).

Both parts report the median of each side, the ratio of the medians and the median of the
per-round ratios (the runs of a round ran back to back, so it is the figure least moved by load that
drifts during the run), then a markdown row for BENCHMARKS.md.

    ./dev bench mds [--rows 50000] [--runs 5] [--batch-size 256] [--compression zstd] [--quick]

``--quick`` (20k rows, 3 rounds of each part, well under a minute here) is what ``bench all`` runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefect_sgpu.pipeline.mds import write_mds  # noqa: E402
from prefect_sgpu.pipeline.streaming import streaming_loader  # noqa: E402


def make_columns(rows: int, dim: int, seed: int = 0) -> dict[str, Any]:
    """The benchmark's data, in memory: a dict of equal-length numpy columns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "id": np.arange(rows, dtype=np.int64),
        "label": rng.integers(0, 10, rows, dtype=np.int64),
        "weight": rng.random(rows),
        "x": rng.standard_normal((rows, dim), dtype=np.float32),
    }


def raw_mdswriter(columns: dict[str, Any], out: str, encodings: dict[str, str], compression: str | None,
                  size_limit: str) -> int:
    """MDSWriter directly, as a user would: one row dict per row, then finish()."""
    from streaming import MDSWriter

    names = list(columns)
    count = len(columns[names[0]])
    with MDSWriter(out=out, columns=encodings, compression=compression, size_limit=size_limit) as writer:
        for i in range(count):
            writer.write({name: columns[name][i] for name in names})
    return count


def summary(ours: list[float], raw: list[float]) -> tuple[float, float, float, float]:
    m_ours, m_raw = statistics.median(ours), statistics.median(raw)
    pair = statistics.median(a / b for a, b in zip(ours, raw))
    return m_ours, m_raw, m_ours / m_raw, pair


def bench_convert(args: argparse.Namespace, columns: dict[str, Any], work: Path) -> dict[str, Any]:
    n = args.rows
    progress = not args.no_progress

    def ours(out: Path, given: dict[str, str] | None = None) -> tuple[float, dict[str, str]]:
        t0 = time.perf_counter()
        shard_set = write_mds(columns, out, columns=given, compression=args.compression, size_limit=args.size_limit,
                              progress=progress)
        elapsed = time.perf_counter() - t0
        assert shard_set.rows == n, shard_set
        return elapsed, shard_set.columns

    def raw(out: Path) -> float:
        t0 = time.perf_counter()
        raw_mdswriter(columns, str(out), encodings, args.compression, args.size_limit)
        return time.perf_counter() - t0

    # warm-up, untimed (imports, first allocations); the column types write_mds infers are
    # what MDSWriter (and the write_mds run with columns= given) is given
    _, encodings = ours(work / "warm-a")
    raw(work / "warm-b")
    shutil.rmtree(work / "warm-a")
    shutil.rmtree(work / "warm-b")

    inferred: list[float] = []
    given: list[float] = []
    direct: list[float] = []
    for run in range(args.runs):  # A, A', B, A, A', B, ...
        out = work / f"inferred-{run}"
        inferred.append(n / ours(out)[0])
        shutil.rmtree(out)
        out = work / f"given-{run}"
        given.append(n / ours(out, encodings)[0])
        shutil.rmtree(out)
        out = work / f"raw-{run}"
        direct.append(n / raw(out))
        shutil.rmtree(out)
    return {"inferred": inferred, "given": given, "raw": direct, "encodings": encodings}


def bench_read(args: argparse.Namespace, columns: dict[str, Any], work: Path) -> dict[str, Any]:
    import warnings

    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader, TensorDataset

    shard_set = write_mds(columns, work / "read-set", compression=args.compression, size_limit=args.size_limit,
                          progress=False)
    tensors = TensorDataset(*(torch.from_numpy(columns[name]) for name in columns))
    bs = args.batch_size
    # streaming hands read-only numpy views to the default collate, which warns once; noise here
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def project_loader(seed: int) -> Any:
        return streaming_loader(shard_set, bs, seed=seed, num_workers=args.workers)

    def raw_streaming_loader(seed: int) -> Any:
        dataset = StreamingDataset(local=shard_set.uri, batch_size=bs, shuffle=True, shuffle_seed=seed)
        return DataLoader(dataset, batch_size=bs, num_workers=args.workers)

    def tensor_loader(seed: int) -> Any:
        return DataLoader(tensors, batch_size=bs, shuffle=True, num_workers=args.workers,
                          generator=torch.Generator().manual_seed(seed))

    def run(make: Any, seed: int) -> tuple[int, float, float]:
        """Build a loader, read one epoch: (samples, epoch s, build s); then drop it and clean /dev/shm."""
        t0 = time.perf_counter()
        loader = make(seed)
        built = time.perf_counter()
        seen = 0
        for batch in loader:
            seen += len(batch["id"] if isinstance(batch, dict) else batch[0])
        done = time.perf_counter()
        if make is not tensor_loader:
            del loader  # the dataset goes with it: none of its shared memory is in use any more
            gc.collect()
            clean_stale_shared_memory()
        return seen, done - built, built - t0

    sides = {"streaming_loader": project_loader, "StreamingDataset": raw_streaming_loader,
             "TensorDataset": tensor_loader}
    cold_seen, cold_s, _ = run(project_loader, 10_000)  # decompresses the shards (zstd) beside them
    for make in sides.values():
        run(make, 10_001)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    builds: dict[str, list[float]] = {name: [] for name in sides}
    seen: dict[str, int] = {}
    for i in range(args.runs):  # A, A', B, A, A', B, ...
        for name, make in sides.items():
            seen[name], elapsed, build = run(make, i)
            rates[name].append(seen[name] / elapsed)
            builds[name].append(build)
    return {"rates": rates, "builds": builds, "seen": seen, "cold": cold_seen / cold_s, "shards": shard_set.shards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=16, help="length of the float32 ndarray column")
    parser.add_argument("--runs", type=int, default=5, help="rounds of runs (one of each side) in each part")
    parser.add_argument("--compression", default="zstd", help="MDS compression on both sides ('none': off)")
    parser.add_argument("--size-limit", default="64mb", help="shard size limit on both sides")
    parser.add_argument("--batch-size", type=int, default=256, help="both loaders of part (b)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of both loaders of part (b)")
    parser.add_argument("--no-progress", action="store_true", help="write_mds without its progress bar")
    parser.add_argument("--only", choices=["convert", "read"], help="run one part")
    parser.add_argument("--quick", action="store_true", help="20k rows, 3 rounds (for `bench all`)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.runs = 20_000, 3
    if args.compression.lower() == "none":
        args.compression = None

    columns = make_columns(args.rows, args.dim)
    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="sgpu-bench-mds-"))
    try:
        convert = bench_convert(args, columns, work) if args.only != "read" else None
        read = bench_read(args, columns, work) if args.only != "convert" else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0]

    import numpy
    import streaming
    import torch

    today = dt.date.today()
    machine = f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f})"
    data = (f"{args.rows} rows: id int64, label int64, weight float64, x ndarray float32[{args.dim}]; "
            f"compression {args.compression}, size limit {args.size_limit}")
    print(f"# MDS, {today} on {platform.node()} ({os.cpu_count()} cores, {platform.machine()}), Python "
          f"{platform.python_version()}, mosaicml-streaming {streaming.__version__}, torch {torch.__version__}, "
          f"numpy {numpy.__version__}; load average {load_start:.1f} at start, {load:.1f} at end")
    print(f"data: {data}")
    if convert is not None:
        m_a, m_b, ratio, pair = summary(convert["inferred"], convert["raw"])
        g_a, _, g_ratio, g_pair = summary(convert["given"], convert["raw"])
        print(f"\n## (a) conversion, {args.runs} rounds alternating (write_mds inferring columns, write_mds with "
              f"columns= given, MDSWriter), fresh folder each run; columns {convert['encodings']}, write_mds "
              f"progress bar {'off' if args.no_progress else 'on'}")
        print(f"write_mds (inferred) rows/s: {[round(x) for x in convert['inferred']]}")
        print(f"write_mds (columns=) rows/s: {[round(x) for x in convert['given']]}")
        print(f"MDSWriter            rows/s: {[round(x) for x in convert['raw']]}")
        print(f"median write_mds inferring columns {m_a:.0f} rows/s, MDSWriter {m_b:.0f} rows/s, ratio of medians "
              f"{ratio:.3f}, median pairwise ratio {pair:.3f} (target >= 0.95)")
        print(f"median write_mds with columns= given {g_a:.0f} rows/s (no per-row type checks), ratio of medians "
              f"{g_ratio:.3f}, median pairwise ratio {g_pair:.3f}")
        print("| date | machine | rows | columns | compression | `write_mds` rows/s | `write_mds(columns=)` rows/s "
              "| `MDSWriter` rows/s | ratio | pairwise ratio | ratio `columns=` | pairwise ratio `columns=` |")
        print(f"| {today} | {machine} | {args.rows} | int64, int64, float64, ndarray f32[{args.dim}] | "
              f"{args.compression} | {m_a:.0f} | {g_a:.0f} | {m_b:.0f} | {ratio:.3f} | {pair:.3f} | {g_ratio:.3f} | "
              f"{g_pair:.3f} |")
    if read is not None:
        rates = read["rates"]
        m_a, m_b, ratio, pair = summary(rates["streaming_loader"], rates["TensorDataset"])
        r_a, _, r_ratio, r_pair = summary(rates["StreamingDataset"], rates["TensorDataset"])
        _, _, w_ratio, w_pair = summary(rates["streaming_loader"], rates["StreamingDataset"])
        print(f"\n## (b) input, {args.runs} rounds alternating (streaming_loader, StreamingDataset in a DataLoader, "
              f"TensorDataset in a DataLoader), one process, batch {args.batch_size}, {args.workers} loader "
              f"workers, shuffled; {read['shards']} shard(s); cold first streaming_loader epoch (decompressing "
              f"the shards) {read['cold']:.0f} samples/s")
        for name, values in rates.items():
            print(f"{name:16s} samples/s: {[round(x) for x in values]}; samples per epoch {read['seen'][name]}, "
                  f"build s (median) {statistics.median(read['builds'][name]):.3f}")
        print(f"median streaming_loader {m_a:.0f} samples/s, TensorDataset {m_b:.0f} samples/s, ratio of medians "
              f"{ratio:.3f}, median pairwise ratio {pair:.3f}")
        print(f"median StreamingDataset {r_a:.0f} samples/s (ratio to TensorDataset {r_ratio:.3f}, pairwise "
              f"{r_pair:.3f}); streaming_loader / StreamingDataset {w_ratio:.3f}, pairwise {w_pair:.3f}")
        print("| date | machine | rows | batch | workers | `streaming_loader` samples/s | `StreamingDataset` samples/s "
              "| `TensorDataset` samples/s | ratio | pairwise ratio | `streaming_loader` / `StreamingDataset` |")
        print(f"| {today} | {machine} | {args.rows} | {args.batch_size} | {args.workers} | {m_a:.0f} | {r_a:.0f} | "
              f"{m_b:.0f} | {ratio:.3f} | {pair:.3f} | {w_ratio:.3f} |")

if __name__ == "__main__":
    main()
