"""The algorithm, checkable against its papers: credit assignment, the update losses and the Flow-GRPO SDE.

Pure numpy/torch: nothing here knows about Ray, actors or the run's files.
"""
