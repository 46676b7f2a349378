"""From costs to a plan for a budget: profiling, the planner, device budgets and the
largest batch."""
