"""G4 stability: a soak with drift, leak and consistency checks."""
