"""The launch layer: what a run will be on this machine (``plan``), the processes it lives in and how they end.
The simulation process and the host that keeps it warm between runs (``launcher``, ``simulation``, and what the
two say to each other: ``protocol``), a SuperNode's long-lived client process (``worker``), the watchdog that
takes them all down with their command (``watchdog``) and time-boxed runs (``timelimit``). The commands
(``cli``, ``sweep``, ``deploy``, ``bench``) start runs through it; it imports none of them."""
