"""What a run leaves in its folder, torch-free: the one npz format (``codec``) and atomic JSON writes
(``jsonsafe``), the checkpoint file, metrics.jsonl and the summaries (``run_io``, ``metrics``), progress.jsonl
(``progress``), the trackers (``tracking``) and the lock that keeps one live run per folder (``runlock``)."""
