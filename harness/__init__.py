"""The DLRM training harness: runs one configuration and returns one TrialResult.

Knows no tuner. Layering: kernels <- harness <- cubic.
"""
