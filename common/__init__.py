"""The floor beneath algorithm/, experts/ and tasks/: what all of them use and none of them owns.

Model loading (where a model is read from, how it is loaded), seeding, the config base and the
tiny models' tokenizer. It imports nothing of the project's other packages, so any of them may
import it (tests/test_layers.py checks every package's imports).
"""
