"""Pipeline sessions: a pipeline target prepared once for a case, on a rank group or here, and run as often as a stage asks."""
