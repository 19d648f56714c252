"""`qkvlab bench`: training and inference speed of the projection schemes, side by side.

run.py orchestrates and holds the shapes and schemes; workloads.py is what gets timed;
timing.py the clocks and memory counters; peak.py the MFU denominator; report.py the tables.
"""
