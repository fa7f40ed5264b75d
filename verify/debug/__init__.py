"""Finding what went wrong: `fuseguard bisect` (the drifting group) and `fuseguard reduce` (the fewest nodes
that fail the same way)."""
