"""Plans as plain data, their memory/time simulator and the optimal solver: pure, no torch."""
