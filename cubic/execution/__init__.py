"""Running a trial: the runner protocol and its Ray runner (`runner.py`), the simulator's runner, trials
spanning nodes (`multinode.py`), and the memory check made before a launch.

The ground floor, beside `space`: it imports only the harness."""
