"""What picks the next trial: the XGBoost proxy (`proxy.py`), warm starts from earlier studies, and the
samplers (`samplers/`, one hook each).

Above `results` (a warm start reads another study's frame); only the tune loop imports it."""
