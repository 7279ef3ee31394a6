"""Closed loop in simulation: env workers (pool), agents, rollouts, the eval and its report."""
