"""Benchmarks: speed against a plain reference loop, discovery quality against a grid sweep, validation overhead.

Each module runs with `python -m bench.<name>`, prints a table and writes JSON (bench/results/<name>.json unless
--out says otherwise). bench/README.md says how to run them; bench/RESULTS.md holds the numbers, with the machine.
"""
