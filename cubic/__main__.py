"""`python -m cubic`: the `cubic` command, for an environment whose scripts are not on PATH."""

from cubic.cli.app import main

main()
