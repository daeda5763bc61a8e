"""The `cubic` command: `app.py` wires one module per command (trial, tune, report, export, verify, calibrate,
workload, schema). The top floor: it may import every other group."""
