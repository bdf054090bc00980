"""Executors, workers and the model runner that turns a scheduler step into one forward."""
