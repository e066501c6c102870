"""Tiny random reward models of real architectures, built in-process for tests (common/tiny.py `tiny:`).

Importing it registers their builders (common/tiny.py `register_tiny`)."""
from tasks.rewards.tiny import clip, detector, ocr, vqa  # noqa: F401
