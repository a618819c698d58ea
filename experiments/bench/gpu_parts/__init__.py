"""The parts of ``experiments/bench/gpu_suite.py``, one module per measurement."""
