"""Evaluation: gold reward of policies on the simulated task, best-of-n, win rates."""
