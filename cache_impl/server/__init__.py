"""The OpenAI-compatible HTTP server around the engine: routes, admin and auth, request bodies and errors, metrics, the
serve command."""
