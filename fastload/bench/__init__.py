"""Benchmarks: ``fastload bench`` and the library behind it and the ``bench/`` scripts.

    cli.py       the ``fastload bench`` command: options (checked), argument parser, text report
    runs.py      the runs: fastload Loader, torch DataLoader, the hardware limit; the JSON report
    baseline.py  the DataLoader baseline: PIL decode + the same augmentation (same crop windows)
    models.py    the real training steps (``--step mlp|cnn``, bench/bench_loop.py): MLP, small CNN
    report.py    measuring and reporting, shared with bench/*.py: Measurement, tables, plot;
                 re-exports the three below
    timing.py    round-robin repeats, Spread (median with min–max), paired ratios, cold starts
    machine.py   the machine description (CPU, cores, memory, GPU, versions)
    headlines.py the headlines of docs/benchmarks.md (median (min–max), paired ratios, first batches) and the table

Importing this package imports nothing (building ``fastload --help`` stays light); import the
module you need.
"""
