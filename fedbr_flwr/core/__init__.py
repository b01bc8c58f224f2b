"""The kernel every algorithm builds on, Flower-free: the client side's classes (``algorithm``), the local-step
loop and evaluation (``training``), the vectorised cohort step (``vectorised``), backbones (``model``), shared
losses, typed settings and the registry that finds algorithms by name, the run schema (``config``), named seed
streams, broadcasts, simulated attackers and the project's errors."""
