"""Memory for the engine: the paged DSA pool, the request-local state pool, and their layout."""
