"""The commands a user types: ``fedbr-run`` (``cli``), ``fedbr-sweep`` (``sweep``), ``fedbr-deploy``
(``deploy``) and the report a sweep writes (``report``). ``fedbr-bench`` lives in its own wing, ``bench``."""
