"""Handing the winner to TorchRec (`export.py`) and re-running it there (`verify.py`).

Above `results` and `study`."""
