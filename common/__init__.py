"""Types shared by every stage: graph I/O contract, recipe schema, artifact manifest."""
