"""The CI gate: stages (contracts, images, perf) run in shared rank pools, judged into one results document.

``run.run_gate(GateOptions)`` runs it; ``stage`` holds the options and the stage protocol. Nothing
is imported here, so that importing one stage does not import the others.
"""
