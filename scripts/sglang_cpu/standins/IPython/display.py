"""``HTML`` and ``display``, the two names sglang/utils.py imports; they refuse to run (notebook output only)."""

from typing import NoReturn


def _unavailable(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("IPython is a stand-in here (scripts/sglang_cpu/README.md): notebook display is not available")


HTML = display = _unavailable
