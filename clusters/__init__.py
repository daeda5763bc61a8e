"""The shipped cluster files (installed as package data: `--cluster NAME` finds them from any directory)."""
