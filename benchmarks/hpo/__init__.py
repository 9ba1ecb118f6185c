"""Hyperparameter search at equal compute for any task a run config describes (see run.py)."""
