"""Tiny random diffusers pipelines of each generator family, built in-process (experts/hub.py `tiny:`)."""
