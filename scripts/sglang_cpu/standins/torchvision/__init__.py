"""Stand-in for torchvision (scripts/sglang_cpu/README.md).

PyPI has no CPU build of torchvision for torch 2.13 and the CUDA wheel fails to import
(``torchvision::nms does not exist``). sglang (and transformers, which finds this package)
import torchvision at module level in image pre-processing code that the attention layer never
runs. Every submodule (``torchvision.transforms.v2.functional``, ``torchvision.io``, ...) and
every name resolves to a placeholder, so those imports and module-level uses such as
``InterpolationMode.BICUBIC`` defaults succeed; calling a placeholder raises, so nothing
silently computes with it.
"""

import sys

from torchvision._unavailable import SubmoduleFinder, module_getattr

__version__ = "0.0.0+parity.standin"  # PEP 440, older than any release: version checks say "too old"
__getattr__ = module_getattr(__name__)

if not any(isinstance(f, SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(SubmoduleFinder(__name__))
