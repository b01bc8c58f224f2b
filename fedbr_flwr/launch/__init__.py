"""The launch layer: the processes a run lives in and how they end. The simulation process and the host that
keeps it warm between runs (``launcher``, ``simulation``), the clients in the simulation's threads
(``inprocess``), a SuperNode's long-lived client process (``worker``), the watchdog that takes them all down
with their command (``watchdog``), the Ray runtime a run joins (``raycluster``), one live run per folder
(``runlock``), time-boxed runs (``timelimit``) and what a host and its simulation process say to each other
(``protocol``). The commands (``cli``, ``sweep``, ``deploy``, ``bench``) start runs through it; it imports
none of them."""
