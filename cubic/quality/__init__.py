"""Whether a configuration trains as well as the baseline: the rules and verdicts (`rules.py`), the screen of
single numerics changes (`screen.py`), and the store of held-out runs kept across studies (`store.py`).

Above `space`, `execution` and `study`."""
