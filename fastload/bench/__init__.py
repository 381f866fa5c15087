"""Benchmarks: ``fastload bench`` and the library behind it and the ``bench/`` scripts.

    cli.py       the ``fastload bench`` command: options (checked), argument parser, text report
    runs.py      the runs: fastload Loader, torch DataLoader, the hardware limit; the JSON report
    baseline.py  the DataLoader baseline: PIL decode + the same augmentation (same crop windows)
    report.py    measuring and reporting, shared with bench/*.py: Measurement, interleaved
                 medians, machine description, tables, plot, README headlines

Importing this package imports nothing (building ``fastload --help`` stays light); import the
module you need.
"""
