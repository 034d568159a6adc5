"""Models built on the reference attention layers (tiny configs in tests, the same code at real sizes).

Kept import-free on purpose: each model module is imported directly
(``from reference_impl.models.zimage_transformer import ZImageTransformer``), so one model's
import cost or breakage never reaches another's.
"""
