"""Benchmarks of funcpipe (run each as ``python benchmarks/<name>.py --help``)."""
