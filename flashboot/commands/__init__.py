"""Sub-commands of the flashboot console script, one module each."""
