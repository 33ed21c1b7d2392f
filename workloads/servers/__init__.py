"""Local servers for tests and examples: the reference server with controlled timing, the shared pool's stores."""
