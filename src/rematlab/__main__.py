"""`python -m rematlab`, as the `rematlab` command: what `torchrun -m rematlab plan ...` runs
on every rank."""

from rematlab.cli import main

main()
