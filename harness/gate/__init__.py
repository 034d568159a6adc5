"""The CI gate: stages (contracts, images, perf) run in shared rank pools, judged into one results document.

``run.run_gate(GateOptions)`` runs it; ``stage`` holds the options and the stage protocol. Nothing
is imported here: rank processes import ``pipeline_runs`` and must not pay for the rest.
"""
