"""Stand-in for IPython (scripts/sglang_cpu/README.md): sglang/utils.py imports ``IPython.display`` at module level."""
