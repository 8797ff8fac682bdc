"""Many engine workers behind one front end: routing policy, prefix index, cluster metrics."""
