"""The ``parity`` command as a module, so that ``python -m parity`` and ``torchrun ... -m parity`` run it.

The harness itself is :mod:`harness`; this package only names its entry point.
"""
