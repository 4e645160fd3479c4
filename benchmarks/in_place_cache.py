"""A script's in-place ``datasets.Dataset`` through the data cache: tokenised in memory (every rank, every
``train()``, before issue 40) against the first and a later ``train()`` with the cache (``data.in_place``).

    python benchmarks/in_place_cache.py [--rows 100000] [--repeats 3]

``--rows`` pre-tokenised rows (the tiny character tokenizer over arithmetic problems, as a Trainer script's
``map(tokenizer)`` leaves them; labels derived as ``DataCollatorForLanguageModeling`` makes them), one process.
Per repetition, interleaved: ``memory`` (``InPlaceRows.rows()`` then ``tokenize_in_memory``: the old path),
``cold`` (``open_in_place`` into an empty cache folder: prepare, tokenise, write, map) and ``warm`` (the same
call again: a hit).  Wall seconds, median (min..max); timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args(argv)
    import datasets

    from trainbridge.data.cache import tokenize_in_memory
    from trainbridge.data.in_place import InPlaceRows, open_in_place
    from trainbridge.data.records import DataOptions
    from trainbridge.demos.tiny_model import arithmetic_problems, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="tb-in-place-"))
    tokenizer = build_tokenizer(work / "tokenizer")
    texts = [p + a for p, a in arithmetic_problems(options.rows, 0)]
    dataset = datasets.Dataset.from_dict({"input_ids": tokenizer(texts)["input_ids"]})
    rows = InPlaceRows(dataset, labels_pad_id=tokenizer.pad_token_id)
    data_options = DataOptions(max_seq_len=64)
    times: dict[str, list[float]] = {"memory": [], "cold": [], "warm": []}
    datasets.disable_progress_bars()
    print(f"- load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {options.rows} rows", flush=True)
    for repeat in range(options.repeats):
        cache = work / f"cache-{repeat}"
        for name in times:
            started = time.perf_counter()
            if name == "memory":
                samples, _ = tokenize_in_memory(rows.rows(), "train_dataset", tokenizer, data_options, None)
            else:
                samples, _ = open_in_place(rows, "train_dataset", tokenizer, data_options, None, cache)
            times[name].append(time.perf_counter() - started)
            assert len(samples) == options.rows
            print(f"  {name:6s} repeat {repeat}: {times[name][-1]:.2f} s", flush=True)
        shutil.rmtree(cache)
    print(f"- load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f}) |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
