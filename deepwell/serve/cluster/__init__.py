"""Many engine workers behind one front end: routing policies, the prefix index, options,
admin routes (drain), cluster metrics and `deepwell worker` (docs/serve.md, "Cluster")."""
