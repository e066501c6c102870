"""Tiny random diffusers pipelines of each generator family, built in-process (common/tiny.py `tiny:`)."""
