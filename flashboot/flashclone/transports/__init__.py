"""How a clone reads its source's bytes: one module per transport."""
