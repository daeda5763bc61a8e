"""The search space: its YAML format (`spec.py`), the loaded space and its rules (`search_space.py`,
which loads it from its parts: `loader`, `conditions`, `knobs`, `torchrec_target`, `space`,
`identity`), the numerics rule (`numerics.py`), the quality runs' settings (`quality_runs.py`), lr
scaling, and the JSON Schemas of every file format (`schemas.py`).

The ground floor, beside `execution`: it imports only the harness."""
