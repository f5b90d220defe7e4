"""The ``safl`` command: the composition root of safl-edge.

The one place that may import every package (``edge_client``, ``aggregator``, ``models``).
Its subcommands import their modules only when chosen, so ``safl device`` loads what
``safl-device`` loads and nothing of the aggregator or torch.
"""
