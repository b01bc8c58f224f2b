"""The Flower adapter: Flower's messages in, calls on the layers below out, and nothing else. The ClientApp and
ServerApp, the node that runs a client or a cohort (``node``, ``cohort``, ``payload``), the Flower strategy over
an algorithm's server side (``strategy``) with its routing, federation and checkpointing, the in-process
backend, the Ray runtime's nodes (``raycluster``) and the one module that reaches into Flower's internals
(``flower_adapter``)."""
