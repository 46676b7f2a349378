"""`python -m rematlab.cli`, as the `rematlab` command."""

from rematlab.cli import main

main()
