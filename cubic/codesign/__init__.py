"""`cubic codesign`: the cluster as knobs of a simulated study; time to train against cost."""
