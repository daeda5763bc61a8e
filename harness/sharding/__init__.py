"""Sharding: plans, the sharded embedding collection, collectives and the 2D replica sync."""
