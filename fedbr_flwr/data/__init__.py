"""The data a run trains on, Flower-free: one catalog entry per dataset (``catalog``), the clients' domain
shifts and tensors (``dataset``) and the partitions (``partition``)."""
