"""One rank's step of a data-parallel job (FSDP2 or DDP): shard the model as the layout says
(`shard`), run and meter that rank's step on the real process group or on a fake one that
stands for N cards in one process (`engine`, `meter`, `group`), and the per-rank costs the
planner's simulator picks candidates with (`pricing`)."""
