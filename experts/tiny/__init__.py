"""Tiny random diffusers pipelines of each generator family, built in-process (common/hub.py `tiny:`)."""
