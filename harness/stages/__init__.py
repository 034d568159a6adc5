"""Gate stages beyond the contracts: each module holds one stage (``name``, ``skip_reason``, ``run``).

:mod:`harness.commands.gate` lists them in ``STAGES``; see its docstring for the protocol.
"""
