"""The shipped search spaces (installed as package data: `cubic tune` finds them from any directory)."""
