"""Tiny random diffusers pipelines of each generator family, built in-process (common/tiny.py `tiny:`).

Importing it registers every tiny builder of experts/ (common/tiny.py `register_tiny`)."""
from experts import tiny_hf  # noqa: F401
from experts.tiny import flux1, flux2, qwen_image, wan  # noqa: F401
