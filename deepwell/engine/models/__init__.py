"""Model definitions, the architecture registry and checkpoint loaders."""
