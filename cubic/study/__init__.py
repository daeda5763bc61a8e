"""What is stored: Optuna's study through its public API (`store.py`), the typed trial record (`record.py`),
cubic's own tables (`tables.py`) and the tuner's lease (`lease.py`).

Above `space` (a study remembers its space's fingerprint)."""
