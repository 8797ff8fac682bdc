"""The model contract, model definitions, the architecture tables and checkpoint loaders."""
