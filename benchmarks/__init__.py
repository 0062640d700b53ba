"""Benchmarks (installed as ``flashboot.benchmarks``): one timing helper, one module per benchmark.

Run them through ``flashboot bench NAME``. Tests never assert a time; these modules do the timing.
"""
